"""The sandbox lifecycle: its states and transitions as data (states.py)."""
