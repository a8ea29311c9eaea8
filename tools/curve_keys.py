"""Make a CURVE key folder for tcp agents (shm/curve.py says what each host keeps):

    python -m tools.curve_keys DIR            # agent and server keypairs, the server authorized
    python -m tools.curve_keys DIR --server NAME   # one more server keypair (NAME.key[_secret]), authorized

Point `serving_config.curve_keys` (or LLM_SERVING_CURVE_KEYS) at the folder on every host; give a
server host only server.key_secret and agent.key, an agent host agent.key_secret and authorized/.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import zmq.auth


def make(folder: Path, server: str = "server") -> None:
    (folder / "authorized").mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    if not (folder / "agent.key_secret").exists():
        zmq.auth.create_certificates(str(folder), "agent")
    public, _ = zmq.auth.create_certificates(str(folder), server)
    shutil.copy(public, folder / "authorized" / f"{server}.key")
    for secret in folder.glob("*.key_secret"):
        secret.chmod(0o600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--server", default="server", help="name of the server keypair to add (default server)")
    args = ap.parse_args(argv)
    make(Path(args.folder), args.server)
    print(f"keys in {args.folder}: agent.key[_secret], {args.server}.key[_secret], authorized/{args.server}.key")
    return 0


if __name__ == "__main__":
    sys.exit(main())
