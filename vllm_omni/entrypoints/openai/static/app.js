// The voice-chat page: one realtime session (/v1/realtime, OpenAI Realtime events) per page, and
// a speech tab for text-to-speech models (speech.js).
// Microphone: an AudioWorklet at the device's rate; the session declares that rate and the
// server resamples. Speech out: PCM16 at 24 kHz, each delta scheduled on a Web Audio clock as
// it arrives. Barge-in: talking (or typing) over the reply stops playback and truncates the
// reply at what was heard. window.voiceChat.state mirrors what the page shows (tests read it).

import { OUTPUT_RATE, Player, floatToPcm16B64 } from "./audio.js";
import { initSpeech } from "./speech.js";

const $ = (id) => document.getElementById(id);

const state = {
  status: "connecting", sessionId: null, model: null, voices: [], mode: "ptt", responding: false,
  responses: 0, lastResponseStatus: null, audioDeltas: 0, samplesReceived: 0, chunksPlayed: 0,
  samplesPlayed: 0, truncations: 0, errors: [], lastReply: "", tts: null, tab: "chat",
};
window.voiceChat = { state };

// ------------------------------------------------------------------ microphone

class Mic {
  constructor(onChunk) { this.onChunk = onChunk; this.ctx = null; this.stream = null; this.sending = false; }

  get rate() { return this.ctx ? this.ctx.sampleRate : null; }

  async open() {
    if (this.ctx) return;
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) throw new Error("this browser gives the page no microphone (it needs https or localhost)");
    this.stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true } });
    this.ctx = new AudioContext();
    await this.ctx.audioWorklet.addModule("/static/pcm-worklet.js");
    const node = new AudioWorkletNode(this.ctx, "pcm-capture");
    node.port.onmessage = (e) => { if (this.sending) this.onChunk(e.data); };
    this.ctx.createMediaStreamSource(this.stream).connect(node);
  }
}

// ------------------------------------------------------------------ the page

const player = new Player((samples) => { state.chunksPlayed++; state.samplesPlayed += samples; });
const mic = new Mic((samples) => send({ type: "input_audio_buffer.append", audio: floatToPcm16B64(samples) }));
let ws = null;
let bubbles = new Map();  // item id -> element

function setStatus(status, text) {
  state.status = status;
  const el = $("status");
  el.className = `status ${status}`;
  el.textContent = text || status;
}

function showError(message) {
  state.errors.push(message);
  const el = $("error");
  el.textContent = message;
  el.hidden = false;
}

function bubble(id, role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.textContent = text;
  $("log").appendChild(el);
  el.scrollIntoView({ block: "end" });
  if (id) bubbles.set(id, el);
  return el;
}

function send(event) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event));
}

function sessionConfig() {
  const handsFree = $("mode").value === "handsfree";
  const session = {
    type: "realtime",
    instructions: $("instructions").value,
    output_modalities: [$("reply").value],
    audio: {
      input: { format: { type: "audio/pcm", rate: mic.rate || OUTPUT_RATE }, turn_detection: handsFree ? { type: "server_vad" } : null },
      output: {},
    },
  };
  if ($("voice").value) session.audio.output.voice = $("voice").value;
  return { type: "session.update", session };
}

function authHeaders() {
  const key = $("apikey").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function loadModel() {
  try {
    const [models, voices] = await Promise.all([fetch("/v1/models", { headers: authHeaders() }), fetch("/v1/audio/voices", { headers: authHeaders() })]);
    if (models.status === 401) { showError("this server needs an API key: enter it under 'more' and reconnect"); return; }
    state.model = (await models.json()).data[0].id;
    const listed = await voices.json();
    state.voices = listed.voices;
    state.tts = listed.task_type || null;  // a text-to-speech model: the speech tab is its page
    const select = $("voice");
    select.length = 1;
    for (const v of state.voices) select.add(new Option(v, v));
    if (!state.voices.length) { $("reply").value = "text"; $("reply").disabled = true; }
  } catch (e) {
    showError(`cannot reach the server: ${e.message}`);
  }
}

function connect() {
  if (ws) { ws.onclose = null; ws.close(); }
  setStatus("connecting", "connecting…");
  const key = $("apikey").value.trim();
  const protocols = ["realtime", ...(key ? [`openai-insecure-api-key.${key}`] : [])];
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime${state.model ? `?model=${encodeURIComponent(state.model)}` : ""}`;
  ws = new WebSocket(url, protocols);
  ws.onopen = () => { setStatus("connected", `connected · ${state.model || "model"}`); send(sessionConfig()); };
  ws.onclose = (e) => {
    state.responding = false;
    setStatus("disconnected", `disconnected (${e.code}${e.reason ? `: ${e.reason}` : ""})`);
  };
  ws.onerror = () => setStatus("failed", "connection failed");
  ws.onmessage = (e) => handle(JSON.parse(e.data));
}

// Talking or typing over the reply: stop it and keep in the history only what was heard.
function interrupt(serverCancels) {
  if (state.responding && !serverCancels) send({ type: "response.cancel" });
  if (player.playing && player.itemId) {
    const heard = player.heardMs();
    player.stop();
    send({ type: "conversation.item.truncate", item_id: player.itemId, content_index: 0, audio_end_ms: heard });
  }
}

const handlers = {
  "session.created": (e) => { state.sessionId = e.session.id; },
  "session.updated": () => {},
  "input_audio_buffer.speech_started": () => { interrupt(true); $("mic").classList.add("live"); },
  "input_audio_buffer.speech_stopped": () => { $("mic").classList.remove("live"); },
  "conversation.item.added": (e) => {
    const item = e.item;
    if (item.role !== "user" || bubbles.has(item.id)) return;
    const text = item.content.map((c) => (c.type === "input_text" ? c.text : c.type === "input_audio" ? "(spoken message)" : "")).join(" ");
    bubble(item.id, "user", text);
  },
  "response.created": (e) => { state.responding = true; state.lastReply = ""; },
  "response.output_item.added": (e) => { bubble(e.item.id, "assistant", ""); },
  "response.output_audio_transcript.delta": (e) => appendText(e.item_id, e.delta),
  "response.output_text.delta": (e) => appendText(e.item_id, e.delta),
  "response.output_audio.delta": (e) => {
    state.audioDeltas++;
    state.samplesReceived += (atob(e.delta).length >> 1);
    player.play(e.item_id, e.delta);
  },
  "conversation.item.truncated": (e) => { state.truncations++; const b = bubbles.get(e.item_id); if (b) b.classList.add("cut"); },
  "response.done": (e) => {
    const r = e.response;
    state.responding = false;
    state.responses++;
    state.lastResponseStatus = r.status;
    const item = r.output && r.output[0];
    const b = item && bubbles.get(item.id);
    if (b && r.status !== "completed") {
      const meta = document.createElement("span");
      meta.className = "meta";
      meta.textContent = r.status_details && r.status_details.reason ? `${r.status} (${r.status_details.reason})` : r.status;
      b.appendChild(meta);
    }
    if (r.status === "failed") showError(`the reply failed: ${r.status_details.error.message}`);
  },
  "error": (e) => showError(e.error.message),
};

function appendText(itemId, delta) {
  state.lastReply += delta;
  const b = bubbles.get(itemId) || bubble(itemId, "assistant", "");
  b.textContent += delta;
  b.scrollIntoView({ block: "end" });
}

function handle(event) {
  const h = handlers[event.type];
  if (h) h(event);
}

// ------------------------------------------------------------------ controls

$("textform").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("text").value.trim();
  if (!text) return;
  player.unlock();
  interrupt(false);
  send({ type: "conversation.item.create", item: { type: "message", role: "user", content: [{ type: "input_text", text }] } });
  send({ type: "response.create" });
  $("text").value = "";
});

$("stop").addEventListener("click", () => interrupt(false));

async function startTalking() {
  player.unlock();
  try {
    const fresh = !mic.ctx;
    await mic.open();
    if (fresh) send(sessionConfig());  // the input rate is now the microphone's
  } catch (e) {
    showError(`microphone: ${e.message}`);
    return;
  }
  if (state.mode === "ptt") interrupt(false);
  mic.sending = true;
  $("mic").classList.add("live");
}

function stopTalking() {
  if (state.mode !== "ptt" || !mic.sending) return;
  mic.sending = false;
  $("mic").classList.remove("live");
  send({ type: "input_audio_buffer.commit" });
  send({ type: "response.create" });
}

$("mic").addEventListener("pointerdown", () => {
  if (state.mode === "ptt") startTalking();
  else if (mic.sending) { mic.sending = false; $("mic").textContent = "● unmute"; }
  else { startTalking(); $("mic").textContent = "● mute"; }
});
$("mic").addEventListener("pointerup", stopTalking);
$("mic").addEventListener("pointerleave", stopTalking);
document.addEventListener("keydown", (e) => {
  if (e.code === "Space" && !e.repeat && document.activeElement.tagName !== "INPUT" && document.activeElement.tagName !== "TEXTAREA") {
    e.preventDefault();
    if (state.mode === "ptt") startTalking();
  }
});
document.addEventListener("keyup", (e) => { if (e.code === "Space") stopTalking(); });

$("mode").addEventListener("change", () => {
  state.mode = $("mode").value;
  mic.sending = false;
  $("mic").classList.remove("live");
  $("mic").textContent = state.mode === "ptt" ? "● hold to talk" : "● start listening";
  send({ type: "input_audio_buffer.clear" });
  send(sessionConfig());
});
for (const id of ["voice", "reply", "instructions"]) $(id).addEventListener("change", () => send(sessionConfig()));
$("keyform").addEventListener("submit", (e) => { e.preventDefault(); $("error").hidden = true; start(); });

// ------------------------------------------------------------------ tabs

function showTab(tab) {
  state.tab = tab;
  $("chat-pane").hidden = tab !== "chat";
  $("speech-pane").hidden = tab !== "speech";
  $("tab-chat").classList.toggle("on", tab === "chat");
  $("tab-speech").classList.toggle("on", tab === "speech");
}
$("tab-chat").addEventListener("click", () => showTab("chat"));
$("tab-speech").addEventListener("click", () => showTab("speech"));

const speech = initSpeech({ authHeaders, apiKey: () => $("apikey").value.trim(), showError });

async function start() {
  await loadModel();
  if (state.tts) {  // a TTS model does not converse: no realtime session, the speech tab
    if (ws) { ws.onclose = null; ws.close(); ws = null; }
    $("tab-chat").disabled = true;
    showTab("speech");
    setStatus("connected", `text to speech · ${state.model}`);
    await speech.load(state.tts);
  } else {
    connect();
    await speech.load(null);
  }
}

start();
