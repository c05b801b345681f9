// Browser side of the realtime duplex client: microphone -> 16 kHz pcm16 appends (200 ms), replies played
// at 24 kHz, transcript shown. Two lanes, chosen before Start:
//  * "model decides when to speak" (native lane): the model takes turns on its own, unit by unit;
//  * unchecked (turn lane): nothing is answered until "Answer now" commits the speech so far and asks for a
//    response (input_audio_buffer.commit with response_create).
// The page acknowledges playback only for audio that really finished playing, so the gateway's history
// (playback_commit_policy "ack_only") holds what the user heard, and it counts the reply samples it received,
// played and dropped (shown under the buttons and in window.realtimeStats, for diagnostics).
"use strict";

const IN_RATE = 16000;
const OUT_RATE = 24000;
const APPEND_MS = 200;
const $ = (id) => document.getElementById(id);

let ws = null;
let ctx = null;
let micStream = null;
let micSource = null;
let capture = null;         // AudioWorkletNode posting microphone blocks (capture-worklet.js)
let downsampler = null;
let playHead = 0;              // AudioContext time where the next reply chunk starts
const playing = new Set();     // scheduled reply chunks not yet ended: {src, samples, responseId, stopped}
const replies = new Map();     // response id -> {playedSamples, done, stale, muted}
let activeResponse = null;     // id of the response being generated, if any
let currentLine = null;
let sessionOpen = false;

// Diagnostics: what reached the page and its audio output (reply samples are 24 kHz mono).
const stats = {
  receivedSamples: 0,    // samples decoded from response.output_audio.delta
  playedSamples: 0,      // samples whose buffer finished playing
  droppedSamples: 0,     // samples stopped before the end (interrupt, cleared output buffer, stop)
  audioDeltas: 0,
  transcriptDeltas: 0,
  responses: 0,
  appendsSent: 0,
  errors: 0,
};
window.realtimeStats = stats;

function log(text) {
  const div = document.createElement("div");
  div.textContent = text;
  $("log").prepend(div);
  while ($("log").childElementCount > 200) $("log").lastElementChild.remove();
}

function showCounters() {
  $("played").textContent = String(stats.playedSamples);
  $("played-ms").textContent = String(Math.round(stats.playedSamples * 1000 / OUT_RATE));
  $("received").textContent = String(stats.receivedSamples);
  $("dropped").textContent = String(stats.droppedSamples);
}

function b64FromInt16(int16) {
  let binary = "";
  const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function int16FromB64(b64) {
  const bin = atob(b64);
  const out = new Int16Array(bin.length >> 1);
  for (let i = 0; i < out.length; i++) out[i] = (bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8)) << 16 >> 16;
  return out;
}

// Streaming linear resampler from the AudioContext rate to 16 kHz. It keeps its phase and the previous
// chunk's last sample, so consecutive chunks join without dropped or repeated samples.
class Downsampler {
  constructor(fromRate) {
    this.step = fromRate / IN_RATE;
    this.pos = 0;        // read position in [previous sample, ...chunk]
    this.prev = 0;
  }

  push(chunk) {
    const out = new Int16Array(Math.ceil((chunk.length - this.pos) / this.step) + 1);
    let n = 0;
    while (this.pos < chunk.length) {
      const i0 = Math.floor(this.pos);
      const frac = this.pos - i0;
      const a = i0 === 0 ? this.prev : chunk[i0 - 1];
      const s = a + (chunk[i0] - a) * frac;
      out[n++] = Math.max(-32768, Math.min(32767, Math.round(s * 32767)));
      this.pos += this.step;
    }
    this.pos -= chunk.length;
    this.prev = chunk[chunk.length - 1];
    return out.subarray(0, n);
  }
}

function send(event) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event));
}

function reply(responseId) {
  if (!replies.has(responseId)) replies.set(responseId, { playedSamples: 0, done: false, stale: false, muted: false });
  return replies.get(responseId);
}

function playPcm16(int16, responseId) {
  const buf = ctx.createBuffer(1, int16.length, OUT_RATE);
  const ch = buf.getChannelData(0);
  for (let i = 0; i < int16.length; i++) ch[i] = int16[i] / 32768;
  const src = ctx.createBufferSource();
  src.buffer = buf;
  src.connect(ctx.destination);
  const chunk = { src, samples: int16.length, responseId, stopped: false };
  src.onended = () => {
    playing.delete(chunk);
    if (chunk.stopped) return;
    stats.playedSamples += chunk.samples;
    const r = reply(responseId);
    r.playedSamples += chunk.samples;
    // Playback truth: acknowledge only what was heard (cumulative per response).
    if (!r.stale) send({ type: "playback.ack", response_id: responseId, played_ms: Math.floor(r.playedSamples * 1000 / OUT_RATE) });
    showCounters();
  };
  playHead = Math.max(playHead, ctx.currentTime + 0.05);
  src.start(playHead);
  playHead += buf.duration;
  playing.add(chunk);
}

// Stop scheduled reply audio (all of it, or one response's), counting it as dropped.
function stopPlayback(responseId = null) {
  for (const chunk of [...playing]) {
    if (responseId !== null && chunk.responseId !== responseId) continue;
    chunk.stopped = true;
    playing.delete(chunk);
    stats.droppedSamples += chunk.samples;
    try { chunk.src.stop(); } catch (_) { /* never started */ }
  }
  if (playing.size === 0) playHead = 0;
  showCounters();
}

function onEvent(ev) {
  if (typeof ev.server_event_seq === "number") send({ type: "session.event_ack", server_event_seq: ev.server_event_seq });
  switch (ev.type) {
    case "session.created":
      sessionOpen = true;
      $("status").textContent = "connected " + ev.session.id;
      break;
    case "session.closed":
      sessionOpen = false;
      $("status").textContent = "session closed (" + (ev.reason || "") + ")";
      break;
    case "response.created":
      stats.responses += 1;
      reply(ev.response_id);
      activeResponse = ev.response_id;
      currentLine = document.createElement("div");
      currentLine.className = "model";
      currentLine.textContent = "model: ";
      reply(ev.response_id).line = currentLine;
      $("transcript").append(currentLine);
      break;
    case "response.output_audio.delta": {
      const pcm = int16FromB64(ev.delta);
      stats.audioDeltas += 1;
      stats.receivedSamples += pcm.length;
      // Audio still in flight when the user interrupted is not played.
      if (reply(ev.response_id).muted) stats.droppedSamples += pcm.length;
      else if (pcm.length) playPcm16(pcm, ev.response_id);
      showCounters();
      break;
    }
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      stats.transcriptDeltas += 1;
      if (currentLine) currentLine.textContent += ev.delta;
      break;
    case "output_audio_buffer.cleared":
      stopPlayback(ev.response_id);
      break;
    case "response.done":
      reply(ev.response_id).done = true;
      if (activeResponse === ev.response_id) activeResponse = null;
      if (ev.response.status !== "completed") {
        stopPlayback(ev.response_id);
        const line = reply(ev.response_id).line;
        if (line) {  // the text may run ahead of the audio that was heard: say the answer was cut
          const note = document.createElement("span");
          note.className = "cut";
          note.textContent = ` [${ev.response.status}]`;
          line.append(note);
        }
      }
      log(`response ${ev.response.status}`);
      break;
    case "error":
      stats.errors += 1;
      log(`error ${ev.error.code}: ${ev.error.message}`);
      break;
    default:
      if (!/^(conversation|response|playback|rate_limits|overlap)\./.test(ev.type)) log(ev.type);
  }
}

async function start() {
  $("start").disabled = true;
  $("native").disabled = true;
  const cfg = await (await fetch("config.json")).json();
  const base = cfg.realtime_url || `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime`;
  stopPlayback();
  if (ctx) await ctx.close();  // the previous session's context
  ctx = new AudioContext();
  await ctx.resume();
  micStream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  ws = new WebSocket(`${base}?duplex=1&autostart=0`);
  ws.onmessage = (m) => onEvent(JSON.parse(m.data));
  await new Promise((resolve, reject) => {
    ws.onopen = resolve;
    ws.onerror = () => reject(new Error("WebSocket connection failed"));
  });
  ws.onerror = () => log("WebSocket error");
  ws.onclose = (e) => {
    sessionOpen = false;
    if (!$("status").textContent.startsWith("session closed")) $("status").textContent = `closed (${e.code})`;
    stopAudio();
  };
  const nativeLane = $("native").checked;
  send({
    type: "session.update",
    session: {
      modalities: ["audio", "text"], input_audio_format: "pcm16", output_audio_format: "pcm16",
      sample_rate_hz: IN_RATE, turn_detection: null, ref_audio: cfg.ref_audio,
      overlap_policy: "listen_only", playback_commit_policy: "ack_only",
      extra_body: { auto_response: nativeLane, force_listen_count: 0 },
    },
  });
  micSource = ctx.createMediaStreamSource(micStream);
  await ctx.audioWorklet.addModule("capture-worklet.js");
  capture = new AudioWorkletNode(ctx, "capture", { numberOfInputs: 1, numberOfOutputs: 0 });
  downsampler = new Downsampler(ctx.sampleRate);
  const perAppend = IN_RATE * APPEND_MS / 1000;
  let pending = [];
  let buffered = 0;
  capture.port.onmessage = (e) => {
    const pcm = downsampler.push(e.data);
    pending.push(pcm);
    buffered += pcm.length;
    if (buffered < perAppend || !sessionOpen) return;
    const joined = new Int16Array(buffered);
    let off = 0;
    for (const p of pending) { joined.set(p, off); off += p.length; }
    pending = []; buffered = 0;
    send({ type: "input_audio_buffer.append", audio: b64FromInt16(joined), sample_rate_hz: IN_RATE });
    stats.appendsSent += 1;
  };
  micSource.connect(capture);
  $("ask").disabled = nativeLane;
  $("interrupt").disabled = false;
  $("stop").disabled = false;
}

function stopAudio() {
  if (capture) { capture.port.onmessage = null; capture.disconnect(); }
  if (micSource) micSource.disconnect();
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  capture = null; micSource = null; micStream = null;
  for (const id of ["ask", "interrupt", "stop"]) $(id).disabled = true;
  $("start").disabled = false;
  $("native").disabled = false;
}

$("start").onclick = () => start().catch((e) => {
  log("start failed: " + e.message);
  if (ws) ws.close();
  stopAudio();
});
$("ask").onclick = () => {
  // Acks for finished replies would arrive after this new user turn and be refused (playback_ack_too_late).
  for (const r of replies.values()) if (r.done) r.stale = true;
  const line = document.createElement("div");
  line.className = "you";
  line.textContent = "you: (spoke)";
  $("transcript").append(line);
  send({ type: "input_audio_buffer.commit", response_create: true });
};
$("interrupt").onclick = () => {
  if (activeResponse !== null) reply(activeResponse).muted = true;
  send({ type: "barge_in" });
  stopPlayback();
};
$("stop").onclick = () => { send({ type: "session.close" }); stopPlayback(); stopAudio(); };
