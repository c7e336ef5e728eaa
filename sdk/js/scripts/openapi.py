"""Prints what sdk/js is generated from or checked against: the daemon's OpenAPI document
(default), or with --error-codes the error-code table: each code's HTTP status as the daemon
answers it (cpuosd.errors.STATUS) and the Python SDK's class for it (cpuos._errors), both
from the one table, cpuos._errors.ERROR_CODES.
Run with the repo's venv: .venv/bin/python sdk/js/scripts/openapi.py"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    if sys.argv[1:] == ["--error-codes"]:
        from cpuos._errors import error_from
        from cpuosd.errors import STATUS

        doc: object = {c: {"status": s, "class": type(error_from(s, c, "")).__name__}
                       for c, s in STATUS.items()}
    else:
        from cpuosd.api.app import create_app

        doc = create_app().openapi()
    json.dump(doc, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
