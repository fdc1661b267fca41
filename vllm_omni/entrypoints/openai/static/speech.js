// The speech tab (text-to-speech models): type or paste text, pick a voice, hear it as it streams
// from the speech socket (/v1/audio/speech/stream), the part the talker has read in bold; make a
// voice from an audio file or the microphone (Base), or from a description (VoiceDesign).
// window.voiceChat.speech mirrors what the tab shows (tests read it).

import { Player } from "./audio.js";

const $ = (id) => document.getElementById(id);

export function initSpeech({ authHeaders, apiKey, showError }) {
  const st = {
    task: null, voices: [], status: "idle", deltas: 0, samplesReceived: 0, samplesPlayed: 0, chunksPlayed: 0,
    spokenTo: 0, utterances: 0, errors: [], made: [], recordedBytes: 0,
  };
  window.voiceChat.speech = st;
  const player = new Player((samples) => { st.chunksPlayed++; st.samplesPlayed += samples; });
  let ws = null;
  let text = "";
  let recording = null;  // {recorder, chunks} while the microphone records
  let recorded = null;  // the last recording (a File)

  function fail(message) {
    st.errors.push(message);
    showError(message);
  }

  function setStatus(status, note) {
    st.status = status;
    $("speech-status").textContent = note || status;
  }

  async function load(task) {
    st.task = task;
    $("tab-speech").disabled = !task;  // an omni model speaks in the voice chat
    if (!task) return;
    $("voice-maker").hidden = task === "CustomVoice";  // its voices are its presets
    for (const el of document.querySelectorAll(".clone")) el.hidden = task !== "Base";
    for (const el of document.querySelectorAll(".design")) el.hidden = task !== "VoiceDesign";
    const response = await fetch("/v1/audio/voices", { headers: authHeaders() });
    if (!response.ok) { fail(`cannot list the voices: ${response.status}`); return; }
    st.voices = (await response.json()).data.map((v) => ({ name: v.name, kind: v.kind }));
    const select = $("speech-voice");
    const chosen = select.value;
    select.length = 0;
    if (task !== "CustomVoice") select.add(new Option(task === "Base" ? "(make a voice below)" : "(the instructions)", ""));
    for (const v of st.voices) select.add(new Option(`${v.name} (${v.kind})`, v.name));
    if (st.voices.some((v) => v.name === chosen)) select.value = chosen;
    setStatus("idle", `${st.voices.length} voice${st.voices.length === 1 ? "" : "s"}`);
  }

  function render() {
    const el = $("spoken");
    el.textContent = "";
    const read = document.createElement("b");
    read.textContent = text.slice(0, st.spokenTo);
    el.append(read, document.createTextNode(text.slice(st.spokenTo)));
  }

  function stop() {
    if (ws) { ws.onclose = null; ws.close(); ws = null; }
    player.stop();
    if (st.status === "speaking") setStatus("stopped");
  }

  function speak() {
    stop();
    text = $("speech-text").value;
    if (!text.trim()) return;
    player.unlock();
    st.spokenTo = 0;
    render();
    setStatus("speaking", "speaking…");
    const key = apiKey();
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/audio/speech/stream`;
    ws = new WebSocket(url, ["realtime", ...(key ? [`openai-insecure-api-key.${key}`] : [])]);
    ws.onopen = () => {
      const session = {};
      for (const [field, id] of [["voice", "speech-voice"], ["language", "speech-language"], ["instructions", "speech-instructions"]]) {
        if ($(id).value.trim()) session[field] = $(id).value.trim();
      }
      ws.send(JSON.stringify({ type: "session.update", session }));
      // Word by word, as a model writes: the server starts speaking at the first phrase.
      for (const piece of text.match(/\s*\S+\s*/g) || []) ws.send(JSON.stringify({ type: "input_text.append", text: piece }));
      ws.send(JSON.stringify({ type: "input_text.end" }));
    };
    ws.onmessage = (e) => handle(JSON.parse(e.data));
    ws.onclose = (e) => {
      ws = null;
      if (st.status === "speaking") setStatus(e.code === 1000 ? "done" : "failed", e.code === 1000 ? "done" : `closed (${e.code})`);
    };
  }

  function handle(event) {
    if (event.type === "speech.audio.delta") {
      st.deltas++;
      st.samplesReceived += atob(event.audio).length >> 1;
      st.spokenTo = Math.max(st.spokenTo, event.text_end);
      player.play(event.utterance_id, event.audio);
      render();
    } else if (event.type === "speech.audio.done") {
      st.utterances++;
      st.spokenTo = Math.max(st.spokenTo, event.text_end);
      render();
      if (event.status === "failed") fail(`speech failed: ${event.error.message}`);
    } else if (event.type === "error") {
      fail(event.error.message);
    }
  }

  async function record() {
    if (recording) { recording.recorder.stop(); return; }
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1 } });
    } catch (e) {
      fail(`microphone: ${e.message}`);
      return;
    }
    const recorder = new MediaRecorder(stream);
    recording = { recorder, chunks: [] };
    recorder.ondataavailable = (e) => { if (e.data.size) recording.chunks.push(e.data); };
    recorder.onstop = () => {
      for (const track of stream.getTracks()) track.stop();
      const type = recorder.mimeType || "audio/webm";
      recorded = new File(recording.chunks, `microphone.${type.includes("ogg") ? "ogg" : "webm"}`, { type });
      st.recordedBytes = recorded.size;
      recording = null;
      $("record-voice").classList.remove("live");
      $("record-voice").textContent = "● record again";
      $("maker-status").textContent = `recorded ${Math.round(recorded.size / 1024)} kB`;
    };
    recorder.start();
    $("record-voice").classList.add("live");
    $("record-voice").textContent = "■ stop recording";
  }

  async function makeVoice() {
    const form = new FormData();
    form.append("name", $("new-voice-name").value.trim());
    if (st.task === "VoiceDesign") {
      form.append("instructions", $("new-voice-instructions").value);
    } else {
      const file = $("new-voice-file").files[0] || recorded;
      if (!file) { fail("choose an audio file or record one first"); return; }
      form.append("audio_sample", file);
      form.append("ref_text", $("new-voice-text").value);
    }
    $("maker-status").textContent = "making…";
    const response = await fetch("/v1/audio/voices", { method: "POST", headers: authHeaders(), body: form });
    const body = await response.json();
    if (!response.ok) { $("maker-status").textContent = ""; fail(`the voice was not made: ${body.error.message}`); return; }
    await load(st.task);
    $("speech-voice").value = body.name;
    $("maker-status").textContent = `made ${body.name}`;
    st.made.push(body.name);
  }

  $("speak").addEventListener("click", speak);
  $("speech-stop").addEventListener("click", stop);
  $("record-voice").addEventListener("click", record);
  $("make-voice").addEventListener("click", makeVoice);
  return { load };
}
