// Copies microphone frames (float32, the context's own rate) to the page, ~20 ms at a time.
class PcmCapture extends AudioWorkletProcessor {
  constructor() { super(); this.parts = []; this.size = 0; }
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) {
      this.parts.push(channel.slice(0));
      this.size += channel.length;
      if (this.size >= sampleRate / 50) {
        const out = new Float32Array(this.size);
        let at = 0;
        for (const p of this.parts) { out.set(p, at); at += p.length; }
        this.port.postMessage(out, [out.buffer]);
        this.parts = []; this.size = 0;
      }
    }
    return true;
  }
}
registerProcessor("pcm-capture", PcmCapture);
