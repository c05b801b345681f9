// Microphone capture on the audio rendering thread: hands the page blocks of mono samples at the
// AudioContext rate (about 43 ms at 48 kHz), so the main thread never runs per render quantum.
"use strict";

const BLOCK = 2048;

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.block = new Float32Array(BLOCK);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;  // no input connected yet
    let offset = 0;
    while (offset < channel.length) {
      const n = Math.min(channel.length - offset, BLOCK - this.filled);
      this.block.set(channel.subarray(offset, offset + n), this.filled);
      this.filled += n;
      offset += n;
      if (this.filled === BLOCK) {
        this.port.postMessage(this.block, [this.block.buffer]);
        this.block = new Float32Array(BLOCK);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor("capture", CaptureProcessor);
