"""`python -m rlix.agents.serve {resources|agent} --target module:Class ...`: one environment
server (what the supervisor starts). A target that cannot be loaded is one line on stderr, exit 2.
The supervisor passes the settings in RLIX_ENV_SERVER_CONFIG (a command line is readable by every
user of the machine, and `options` may hold credentials); `--config` is for a server started by hand."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import uvicorn

from rlix import env
from rlix.agents.sdk import AgentServer, ResourcesServer
from rlix.envs.agent_config import EnvConfig


def load(target: str, base: type) -> type:
    """The class `module:Class`, which must subclass `base`; ValueError says why not."""
    module, _, name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except Exception as exc:  # noqa: BLE001 - the user's module: any error is the reason
        raise ValueError(f"cannot import {module}: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{target} is not a {base.__name__} subclass")
    return cls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlix.agents.serve")
    ap.add_argument("role", choices=["resources", "agent"])
    ap.add_argument("--target", required=True, help="module:Class")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", default=None,
                    help="the environment's settings (EnvConfig as JSON; default: RLIX_ENV_SERVER_CONFIG, else {})")
    ap.add_argument("--options", default=None,
                    help="resources: keyword arguments of its class (JSON object; replaces the config's options)")
    ap.add_argument("--resources-url", default=None, help="agent: where its resources server is")
    args = ap.parse_args(argv)
    try:
        cfg = EnvConfig.model_validate_json(args.config or env.env_server_config() or "{}")
        if args.options is not None:
            options = json.loads(args.options)
            if not isinstance(options, dict):
                raise ValueError("--options must be a JSON object")
            cfg = cfg.model_copy(update={"options": options})
        if args.role == "resources":
            server = load(args.target, ResourcesServer)(tool_latency_s=cfg.tool_latency_s, **cfg.options)
        else:
            if not args.resources_url:
                raise ValueError("an agent needs --resources-url")
            server = load(args.target, AgentServer)(args.resources_url, cfg)
    except Exception as exc:  # noqa: BLE001 - one line, exit 2
        print(f"rlix.agents.serve: {args.role} {args.target}: {type(exc).__name__}: {exc}".replace("\n", " "),
              file=sys.stderr)
        return 2
    uvicorn.run(server.create_app(), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
