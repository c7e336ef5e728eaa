"""What the tests (and bench/) share: the daemon harness (``daemon``), the fake internet
(``fakenet``), stand-ins (``fakes``). Not part of the shipped package: ``tests/`` is on
``sys.path`` under pytest (its conftest), bench/ puts it there itself."""
