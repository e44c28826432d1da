"""A built-in engine in its own process for the IPC handoff tests: it serves over HTTP like any engine
and, told `dump PATH` on stdin, writes the weights it computes with to PATH (torch.save), answering
`dumped`. Run as `python tests/harness/ipc_engine.py MODEL_DIR KEY [DEVICE]`; prints `engine ready at
URL`."""

import sys

import torch

from generator_fleet.engine import EngineServer


def main() -> None:
    model_dir, key = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    server = EngineServer(model_dir, api_key=key, torch_threads=1, device=device).start()
    print(f"engine ready at {server.url}", flush=True)
    for line in sys.stdin:
        cmd, _, path = line.strip().partition(" ")
        if cmd == "dump":
            weights = {n: t.detach().clone() for n, t in server.runner.model.state_dict().items()}
            torch.save(weights, path)
            print("dumped", flush=True)
    server.stop()


if __name__ == "__main__":
    main()
