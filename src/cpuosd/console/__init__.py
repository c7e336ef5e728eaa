"""The web console at ``/ui``: a small Preact app (sources in ``console/`` at the top of the
repository, built by Vite into ``static/``) served by the daemon, signed in with an API key
exchanged for a session cookie (``sessions``), and calling only the public API, as the SDKs
do (``routes``: the page, its assets and the sign-in)."""
