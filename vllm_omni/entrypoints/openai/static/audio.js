// Audio helpers the page's tabs share: PCM16 <-> float, and a player that schedules each chunk
// on a Web Audio clock as it arrives (24 kHz, the server's output rate).

export const OUTPUT_RATE = 24000;

export function pcm16ToFloat(b64) {
  const bin = atob(b64);
  const out = new Float32Array(bin.length >> 1);
  for (let i = 0; i < out.length; i++) {
    let v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    out[i] = v / 32768;
  }
  return out;
}

export function floatToPcm16B64(samples) {
  const bytes = new Uint8Array(samples.length * 2);
  for (let i = 0; i < samples.length; i++) {
    const v = Math.max(-32768, Math.min(32767, Math.round(samples[i] * 32767)));
    bytes[2 * i] = v & 0xff;
    bytes[2 * i + 1] = (v >> 8) & 0xff;
  }
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(bin);
}

// onPlayed(samples) runs as each chunk finishes playing.
export class Player {
  constructor(onPlayed) { this.onPlayed = onPlayed; this.ctx = null; this.head = 0; this.sources = new Set(); this.itemId = null; this.itemStart = 0; this.itemSamples = 0; }

  unlock() {  // from a user gesture: browsers start audio only after one
    if (!this.ctx) this.ctx = new AudioContext({ sampleRate: OUTPUT_RATE });
    if (this.ctx.state === "suspended") this.ctx.resume().catch(() => {});
  }

  play(itemId, b64) {
    this.unlock();
    const samples = pcm16ToFloat(b64);
    if (!samples.length) return;
    const buffer = this.ctx.createBuffer(1, samples.length, OUTPUT_RATE);
    buffer.copyToChannel(samples, 0);
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    const at = Math.max(this.ctx.currentTime + 0.05, this.head);
    if (itemId !== this.itemId) { this.itemId = itemId; this.itemStart = at; this.itemSamples = 0; }
    this.itemSamples += samples.length;
    this.head = at + buffer.duration;
    source.onended = () => { this.sources.delete(source); this.onPlayed(samples.length); };
    this.sources.add(source);
    source.start(at);
  }

  get playing() { return this.sources.size > 0; }

  heardMs() {  // how much of the current item has come out of the speakers
    const ms = (this.ctx.currentTime - this.itemStart) * 1000;
    return Math.floor(Math.max(0, Math.min(ms, this.itemSamples * 1000 / OUTPUT_RATE)));
  }

  stop() {
    for (const s of this.sources) { s.onended = null; s.stop(); }
    this.sources.clear();
    this.head = 0;
  }
}
