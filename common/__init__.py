"""Shared leaves: config helpers every section uses (`config.py`: `bad`, bounded ints), the HTTP guard of
every server (`http_guard.py`: bearer tokens, body and slow-client limits), log text (`logtext.py`),
address helpers (`net.py`: free ports, the address peers dial), the CA that HTTPS and `rediss://`
clients trust (`tls.py`: `$SLIPSTREAM_CA_CERT`) and a process's start-up without the cyclic garbage
collector (`startup.py`).

Owns nothing of the job.

May import: nothing of the project.
"""
