"""cpuosd: the cpuos daemon (REST + streaming API, sandbox lifecycle, backends)."""
