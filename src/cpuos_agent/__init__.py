"""cpuos guest agent and the shared wire protocol (stdlib only)."""
