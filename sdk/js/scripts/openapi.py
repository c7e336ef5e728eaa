"""Prints what sdk/js is generated from or checked against: the daemon's OpenAPI document
(default), or with --error-codes the error-code table (cpuos_agent.protocol.ERROR_CODES).
Run with the repo's venv: .venv/bin/python sdk/js/scripts/openapi.py"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    if sys.argv[1:] == ["--error-codes"]:
        from cpuos_agent.protocol import ERROR_CODES

        doc: object = {c: {"status": s, "class": k} for c, (s, k, _) in ERROR_CODES.items()}
    else:
        from cpuosd.api.app import create_app

        doc = create_app().openapi()
    json.dump(doc, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
