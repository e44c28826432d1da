"""Shared leaves: config helpers every section uses (`config.py`: `bad`, bounded ints), the HTTP guard of
every server (`http_guard.py`: bearer tokens, body and slow-client limits), log text (`logtext.py`) and
address helpers (`net.py`: free ports, the address peers dial).

Owns nothing of the job.

May import: nothing of the project.
"""
