"""The browser app: Gradio page, WebRTC media, latency panel, recording and replay."""
