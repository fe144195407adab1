// talkloop browser client: WebRTC to the app (no STUN/TURN: localhost), the microphone up,
// the character's video and voice down, and delivery reports measured here in the browser.
(() => {
  const SILENT_RMS = 0.003, LOUD_RMS = 0.01, QUIET_BEFORE_MS = 150;
  // The voice and the microphone are read this often: no longer than an analyser's 512 samples (10.7 ms at
  // 48 kHz), so no sample goes unread, and no more often: each read runs on the page's main thread.
  const LEVEL_POLL_MS = 10;
  // Barge-in at the page: the user's voice (the echo-cancelled microphone) this loud for config.interruption_ms
  // while the character's voice played in the last VOICE_RECENT_MS silences the character at once; the server's
  // barge_in confirms it (its own VAD, ~0.2-0.7 s later), and the voice comes back once what was buffered has
  // drained: quiet for DRAINED_MS, longer than the pauses inside the reply's own speech (Piper's, at commas and
  // between sentences, run past 0.4 s), which would otherwise let the cut reply's buffered rest be heard;
  // unconfirmed (a cough the server ignored), it comes back after UNCONFIRMED_MS.
  const MIC_SPEECH_RMS = 0.02, VOICE_RECENT_MS = 250, DRAINED_MS = 600, UNCONFIRMED_MS = 1500;
  const state = { pc: null, channel: null, mic: null, ctx: null, timer: null, syncTimer: null, onsets: [], frames: [], pending: new Map(), framesShown: 0,
                  watching: false, startTicket: 0, micCtx: null, micTimer: null, voiceLoudAt: -Infinity,
                  silencedAt: null, silenceConfirmed: false };
  // Bumped by every connect() and disconnect(): a connect() still in flight from before (Start pressed twice, a
  // preset switched twice, Stop during a start) finds itself stale after its next await, closes what it opened
  // and sends no offer, so it cannot take the place of the connection the page shows.
  let generation = 0;
  // Bumped by Start, Restart, a preset switch and Stop: a session start answered after Stop connects nothing, and a
  // connect() still in flight when another is asked for sends no offer (the server is replacing its session).
  let requests = 0;
  // Start, Restart and switches not yet answered: an answer that comes while another is still awaited connects
  // nothing (the server is replacing the session it names); the last answer connects.
  let unanswered = 0;

  const epochMs = () => performance.timeOrigin + performance.now();
  const $ = (id) => document.getElementById(id);

  function status(text, isError) {
    const el = $("tl-status");
    if (el) { el.textContent = text; el.classList.toggle("tl-error", !!isError); }
  }

  async function reportError(message) {
    status(message, true);
    try {
      await fetch("/talkloop/client-error", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ message }) });
    } catch (e) { /* the page already shows it */ }
  }

  // Audio onsets of the character's voice as played here: silence, then sound.
  function watchAudio(stream) {
    state.ctx = new AudioContext();
    const source = state.ctx.createMediaStreamSource(stream);
    const analyser = state.ctx.createAnalyser();
    analyser.fftSize = 512;
    source.connect(analyser);
    const buf = new Float32Array(analyser.fftSize);
    let quietSince = epochMs();
    clearInterval(state.timer);
    state.timer = setInterval(() => {
      analyser.getFloatTimeDomainData(buf);
      let sum = 0;
      for (const x of buf) sum += x * x;
      const rms = Math.sqrt(sum / buf.length), t = epochMs();
      if (rms > LOUD_RMS) state.voiceLoudAt = t;
      if (state.silencedAt !== null && (state.silenceConfirmed ? t - state.voiceLoudAt >= DRAINED_MS : t - state.silencedAt >= UNCONFIRMED_MS)) {
        unsilence();
      }
      if (rms < SILENT_RMS) { if (quietSince === null) quietSince = t; }
      else if (rms > LOUD_RMS && quietSince !== null) {
        if (t - quietSince >= QUIET_BEFORE_MS) { state.onsets.push(t); state.onsets = state.onsets.slice(-50); checkPending(); }
        quietSince = null;
      }
    }, LEVEL_POLL_MS);
  }

  // The user speaking over the character: the character's voice is silenced here (the video element muted).
  function silence() {
    if (state.silencedAt !== null) return;
    $("tl-video").muted = true;
    state.silencedAt = epochMs();
    state.silenceConfirmed = false;
  }

  function unsilence() {
    $("tl-video").muted = false;
    state.silencedAt = null;
  }

  function watchMic(stream, interruptionMs) {
    if (!interruptionMs) return;
    state.micCtx = new AudioContext();
    const analyser = state.micCtx.createAnalyser();
    analyser.fftSize = 512;
    state.micCtx.createMediaStreamSource(stream).connect(analyser);
    const buf = new Float32Array(analyser.fftSize);
    let loudSince = null;
    clearInterval(state.micTimer);
    state.micTimer = setInterval(() => {
      analyser.getFloatTimeDomainData(buf);
      let sum = 0;
      for (const x of buf) sum += x * x;
      const rms = Math.sqrt(sum / buf.length), t = epochMs();
      if (rms >= MIC_SPEECH_RMS) { if (loudSince === null) loudSince = t; }
      else if (rms < MIC_SPEECH_RMS / 2) loudSince = null;
      if (loudSince !== null && t - loudSince >= interruptionMs && t - state.voiceLoudAt <= VOICE_RECENT_MS) silence();
    }, LEVEL_POLL_MS);
  }

  // Every frame the video element presents, with when it was presented.
  function watchVideo(video) {
    if (state.watching) return;  // one callback chain for the element, whatever it plays
    state.watching = true;
    const offset = performance.timeOrigin;
    const onFrame = (now, meta) => {
      state.framesShown += 1;
      state.frames.push(offset + meta.presentationTime);
      state.frames = state.frames.slice(-400);
      checkPending();
      video.requestVideoFrameCallback(onFrame);
    };
    video.requestVideoFrameCallback(onFrame);
  }

  // A turn's first speaking frame left the server at released_ms: report the first voice
  // onset played after it, and the first frame presented with that voice.
  function checkPending() {
    for (const [turn, released] of state.pending) {
      const audio = state.onsets.find((t) => t >= released);
      if (audio === undefined) continue;
      const frame = state.frames.find((t) => t >= audio - 1000 / 48);
      if (frame === undefined) continue;
      state.pending.delete(turn);
      send({ type: "delivered", turn, audio_ms: audio, frame_ms: frame });
    }
  }

  function send(message) {
    if (state.channel && state.channel.readyState === "open") state.channel.send(JSON.stringify(message));
  }

  function onMessage(event) {
    const message = JSON.parse(event.data);
    if (message.type === "ping") send({ type: "pong", sent: message.sent, browser_ms: epochMs() });
    else if (message.type === "speaking") {
      state.pending.set(message.turn, message.released_ms === null ? epochMs() - 5000 : message.released_ms);
      checkPending();
    } else if (message.type === "barge_in") {  // the server cut the reply: what the page still buffers is not played
      silence();
      state.silenceConfirmed = true;
    }
  }

  // Audio/video sync as the browser schedules it: the estimated playout times (sender's clock)
  // of the latest video and audio frames received; their difference is within a frame when in sync.
  async function reportSync() {
    if (!state.pc) return;
    const playout = {};
    (await state.pc.getStats()).forEach((r) => {
      if (r.type === "inbound-rtp" && r.estimatedPlayoutTimestamp) playout[r.kind] = r.estimatedPlayoutTimestamp;
    });
    if (playout.audio && playout.video) send({ type: "av_sync", offset_ms: playout.video - playout.audio });
  }

  async function connect() {
    await hangUp();
    const mine = ++generation, ticket = requests;
    let mic = null, pc = null;
    const stale = () => {  // a newer connect(), a disconnect() or another session asked for came since: drop what this one opened
      if (mine === generation && ticket === requests) return false;
      if (pc) pc.close();
      if (mic) mic.getTracks().forEach((t) => t.stop());
      return true;
    };
    const config = await (await fetch("/talkloop/client-config")).json();
    if (stale()) return false;
    status("connecting…");
    if (config.audio_input === "browser") {
      try {
        // the browser's processing as the app's settings say (config.microphone: echoCancellation, autoGainControl,
        // noiseSuppression); with its gain control on, the first and last words of a question were lost
        mic = await navigator.mediaDevices.getUserMedia({ audio: { ...config.microphone, channelCount: 1 } });
      } catch (e) {
        if (stale()) return false;
        const denied = e && (e.name === "NotAllowedError" || e.name === "SecurityError");
        await reportError(denied ? "Microphone access was denied: allow the microphone for this page and press Start again."
                                 : `No microphone: ${e && e.message ? e.message : e}`);
        return false;
      }
      if (stale()) return false;
    }
    pc = new RTCPeerConnection({ iceServers: [] });
    state.pc = pc;
    state.mic = mic;
    if (mic) {
      mic.getTracks().forEach((track) => pc.addTrack(track, mic));
      watchMic(mic, config.interruption_ms);
    }
    else pc.addTransceiver("audio", { direction: "recvonly" });
    pc.addTransceiver("video", { direction: "recvonly" });
    state.channel = pc.createDataChannel("talkloop");
    state.channel.onmessage = onMessage;
    const video = $("tl-video");
    const remote = new MediaStream();
    pc.ontrack = (event) => {
      if (mine !== generation) return;
      remote.addTrack(event.track);
      if (video.srcObject !== remote) { video.srcObject = remote; watchVideo(video); }
      if (event.track.kind === "audio") watchAudio(remote);
      video.play().catch(() => status("press the page once to let the character's voice play", true));
    };
    clearInterval(state.syncTimer);
    state.syncTimer = setInterval(reportSync, 1000);
    pc.onconnectionstatechange = () => {
      if (mine !== generation) return;
      if (pc.connectionState === "connected") status("live: talk to the character");
      if (pc.connectionState === "failed") reportError("The connection to the app failed.");
    };
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise((resolve) => {
      if (pc.iceGatheringState === "complete") return resolve();
      pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && resolve());
      setTimeout(resolve, 2000);
    });
    if (stale()) return false;
    const answer = await fetch("/talkloop/offer", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: pc.localDescription.type }) });
    if (stale()) return false;
    if (!answer.ok) {
      const error = (await answer.json()).error || "the app refused the connection";
      await hangUp();  // no connection: the microphone is let go too
      await reportError(error);
      return false;
    }
    await pc.setRemoteDescription(await answer.json());
    return !stale();
  }

  // Gradio hooks. Start, Restart and a preset switch take a ticket when clicked; once the server answered, the page
  // connects if the answer names a session and nothing (Stop, another click) came in between, and otherwise hangs up.
  function requested() {
    state.startTicket = ++requests;
    unanswered += 1;
  }

  async function afterStart(answer) {
    unanswered = Math.max(0, unanswered - 1);
    if (unanswered > 0) return false;
    if (state.startTicket === requests && typeof answer === "string" && answer.startsWith("session ")) return connect();
    if (state.startTicket === requests) await hangUp();
    return false;
  }

  // Stop: whatever start is still being answered connects nothing.
  async function disconnect() {
    requests += 1;
    await hangUp();
  }

  async function hangUp() {
    generation += 1;
    if (state.pc) { state.pc.close(); state.pc = null; }
    if (state.mic) { state.mic.getTracks().forEach((t) => t.stop()); state.mic = null; }
    clearInterval(state.timer);
    clearInterval(state.syncTimer);
    clearInterval(state.micTimer);
    if (state.ctx) { await state.ctx.close(); state.ctx = null; }
    if (state.micCtx) { await state.micCtx.close(); state.micCtx = null; }
    if (state.silencedAt !== null) unsilence();
    state.voiceLoudAt = -Infinity;
    state.pending.clear();
    status("stopped");
  }

  window.talkloop = { connect, disconnect, requested, afterStart, state };
})();
