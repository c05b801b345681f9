// Browser side of the realtime duplex client: microphone -> 16 kHz pcm16 appends (200 ms), replies played
// at 24 kHz, transcript shown. "Answer now" commits and asks for a response (turn lane); with "model decides"
// checked the session runs in the native lane and the model takes turns on its own.
"use strict";

const IN_RATE = 16000;
const OUT_RATE = 24000;
const APPEND_MS = 200;
const $ = (id) => document.getElementById(id);

let ws = null;
let ctx = null;
let micStream = null;
let processor = null;
let pending = [];          // Float32 chunks at the context rate, waiting to be resampled and sent
let playHead = 0;          // AudioContext time where the next reply chunk starts
let playedSamples = 0;     // reply samples scheduled for output (exposed for tests)
let currentLine = null;
let activeResponse = null;
window.realtimeStats = { outputSamples: 0, audioDeltas: 0, responses: 0, events: [] };

function log(text) {
  const div = document.createElement("div");
  div.textContent = text;
  $("log").prepend(div);
}

function b64FromInt16(int16) {
  let binary = "";
  const bytes = new Uint8Array(int16.buffer);
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function int16FromB64(b64) {
  const bin = atob(b64);
  const out = new Int16Array(bin.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = (bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8)) << 16 >> 16;
  return out;
}

function resampleTo16k(chunks, fromRate) {
  const total = chunks.reduce((n, c) => n + c.length, 0);
  const joined = new Float32Array(total);
  let off = 0;
  for (const c of chunks) { joined.set(c, off); off += c.length; }
  const outLen = Math.floor(total * IN_RATE / fromRate);
  const out = new Int16Array(outLen);
  for (let i = 0; i < outLen; i++) {
    const pos = i * fromRate / IN_RATE;
    const i0 = Math.floor(pos), frac = pos - i0;
    const s = joined[i0] * (1 - frac) + (joined[Math.min(i0 + 1, total - 1)] || 0) * frac;
    out[i] = Math.max(-32768, Math.min(32767, Math.round(s * 32767)));
  }
  return out;
}

function send(event) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event));
}

function playPcm16(int16) {
  const buf = ctx.createBuffer(1, int16.length, OUT_RATE);
  const ch = buf.getChannelData(0);
  for (let i = 0; i < int16.length; i++) ch[i] = int16[i] / 32768;
  const src = ctx.createBufferSource();
  src.buffer = buf;
  src.connect(ctx.destination);
  playHead = Math.max(playHead, ctx.currentTime + 0.05);
  src.start(playHead);
  playHead += buf.duration;
  playedSamples += int16.length;
  window.realtimeStats.outputSamples = playedSamples;
}

function onEvent(ev) {
  window.realtimeStats.events.push(ev.type);
  if (typeof ev.server_event_seq === "number") send({ type: "session.event_ack", server_event_seq: ev.server_event_seq });
  switch (ev.type) {
    case "session.created":
      $("status").textContent = "connected " + ev.session.id;
      break;
    case "response.created":
      activeResponse = ev.response_id;
      window.realtimeStats.responses += 1;
      currentLine = document.createElement("div");
      currentLine.className = "model";
      currentLine.textContent = "model: ";
      $("transcript").append(currentLine);
      break;
    case "response.output_audio.delta":
      window.realtimeStats.audioDeltas += 1;
      playPcm16(int16FromB64(ev.delta));
      send({ type: "playback.ack", response_id: ev.response_id, played_ms: ev.metadata.audio_duration_ms });
      $("played").textContent = Math.round(playedSamples * 1000 / OUT_RATE);
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      if (currentLine) currentLine.textContent += ev.delta;
      break;
    case "response.done":
      if (ev.response_id === activeResponse) activeResponse = null;
      log(`response ${ev.response.status}`);
      break;
    case "response.listen":
      break;
    case "error":
      log(`error ${ev.error.code}: ${ev.error.message}`);
      break;
    default:
      if (!ev.type.startsWith("conversation.") && !ev.type.startsWith("response.")) log(ev.type);
  }
}

async function start() {
  const cfg = await (await fetch("config.json")).json();
  const base = cfg.realtime_url || `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime`;
  ctx = new AudioContext();
  micStream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  ws = new WebSocket(`${base}?duplex=1&autostart=0`);
  ws.onmessage = (m) => onEvent(JSON.parse(m.data));
  ws.onclose = () => { $("status").textContent = "closed"; stopAudio(); };
  await new Promise((resolve, reject) => { ws.onopen = resolve; ws.onerror = reject; });
  send({
    type: "session.update",
    session: {
      modalities: ["audio", "text"], input_audio_format: "pcm16", output_audio_format: "pcm16",
      sample_rate_hz: IN_RATE, turn_detection: null, ref_audio: cfg.ref_audio,
      overlap_policy: "listen_only", playback_commit_policy: "ack_only",
      extra_body: { auto_response: $("native").checked, force_listen_count: 0 },
    },
  });
  const source = ctx.createMediaStreamSource(micStream);
  processor = ctx.createScriptProcessor(4096, 1, 1);
  const perAppend = Math.round(ctx.sampleRate * APPEND_MS / 1000);
  let buffered = 0;
  processor.onaudioprocess = (e) => {
    const data = new Float32Array(e.inputBuffer.getChannelData(0));
    pending.push(data);
    buffered += data.length;
    if (buffered >= perAppend) {
      const pcm = resampleTo16k(pending, ctx.sampleRate);
      pending = []; buffered = 0;
      send({ type: "input_audio_buffer.append", audio: b64FromInt16(pcm), sample_rate_hz: IN_RATE });
    }
  };
  source.connect(processor);
  processor.connect(ctx.destination);
  for (const id of ["ask", "interrupt", "stop"]) $(id).disabled = false;
  $("start").disabled = true;
}

function stopAudio() {
  if (processor) processor.disconnect();
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  processor = null; micStream = null;
  for (const id of ["ask", "interrupt", "stop"]) $(id).disabled = true;
  $("start").disabled = false;
}

$("start").onclick = () => start().catch((e) => log("start failed: " + e));
$("ask").onclick = () => {
  const line = document.createElement("div");
  line.className = "you";
  line.textContent = "you: (spoke)";
  $("transcript").append(line);
  send({ type: "input_audio_buffer.commit", response_create: true });
};
$("interrupt").onclick = () => { send({ type: "barge_in" }); playHead = ctx ? ctx.currentTime : 0; };
$("stop").onclick = () => { send({ type: "session.close" }); stopAudio(); };
