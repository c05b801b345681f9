"""The MiniCPM-o gateway: FastAPI front for the three gRPC stages (OpenAI chat, realtime, launcher)."""
