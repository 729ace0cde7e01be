"""Fast Start: a daemon per device holds the loaded, sharded weights; a new engine maps them instead of reading the
checkpoint again. protocol.py (the wire), key.py (what must match), daemon.py, launcher.py, ipc_loader.py (engine).
"""
