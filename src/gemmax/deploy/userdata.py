"""The EC2 user-data script: install gemmax, restore the compile cache, serve under systemd.

cloud-init runs it once as root at first boot. It installs gemmax into /opt/gemmax (a venv, with
the jax plugin extra for the instance's accelerator and the `aws` extra for s3fs), restores the
compile cache from the S3 URL (a missing tarball on the first launch is not an error), and installs
a systemd unit whose ExecStartPre logs the device policy and whose ExecStopPost pushes the cache back:
systemd stops the unit when the instance shuts down or is terminated, so the cache is pushed before
the machine goes away, and `terminate` also asks for a push first (SSM Run Command) unless told not
to. The instance reads S3 with its instance profile's role; no credential is in the script.
"""

from __future__ import annotations

import shlex

CACHE_DIR = "/var/cache/gemmax"
VENV = "/opt/gemmax"
BUILTIN = "builtin"  # a deployment's model when `gemmax serve` gets no --model (the built-in Gemma 3 270M)


def model_args(model: str) -> list[str]:
    return [] if model == BUILTIN else ["--model", model]


def unit_command(argv: list[str]) -> str:
    """argv as a systemd Exec line: shell-quoted (systemd splits single-quoted words as a shell does,
    but C-unescapes backslashes even inside quotes: doubled here), then `%` and `$` doubled (systemd
    expands specifiers and environment variables even inside quotes: a URL holding %2D or $ would
    reach the command changed, or the line be dropped)."""
    return shlex.join(argv).replace("\\", "\\\\").replace("%", "%%").replace("$", "$$")


def user_data(*, model: str, port: int, package: str, cache_url: str | None, serve_args: list[str],
              api_key_env: str | None = None) -> str:
    """The script, as text (boto3 base64-encodes it)."""
    gemmax = f"{VENV}/bin/gemmax"
    serve = unit_command([gemmax, "serve", "--host", "0.0.0.0", "--port", str(port), *model_args(model), *serve_args])
    restore = (f"{gemmax} cache import {shlex.quote(cache_url)} || echo {shlex.quote(f'no compile cache at {cache_url} yet')}"
               if cache_url else "echo 'no compile cache URL: compiling at start'")
    push = f"ExecStopPost=-{unit_command([gemmax, 'cache', 'export', cache_url])}" if cache_url else ""
    key_line = f"Environment=GEMMAX_API_KEY={api_key_env}" if api_key_env else ""
    return f"""#!/bin/bash
# gemmax deployment (gemmax.deploy.userdata): install, restore the compile cache, serve under systemd.
set -euxo pipefail
exec > >(tee -a /var/log/gemmax-user-data.log) 2>&1
export HOME="${{HOME:-/root}}" GEMMAX_COMPILE_CACHE={CACHE_DIR}
python3 -m venv {VENV} || {{ apt-get update -q && apt-get install -y -q python3-venv && python3 -m venv {VENV}; }}
{VENV}/bin/pip install --upgrade pip
{VENV}/bin/pip install --upgrade {shlex.quote(package)}
mkdir -p {CACHE_DIR}
{restore}
cat > /etc/systemd/system/gemmax.service <<'UNIT'
[Unit]
Description=gemmax serve (OpenAI-compatible)
After=network-online.target
Wants=network-online.target

[Service]
Environment=GEMMAX_COMPILE_CACHE={CACHE_DIR}
Environment=PYTHONUNBUFFERED=1 HOME=/root
{key_line}
ExecStartPre={gemmax} policy
ExecStart={serve}
{push}
TimeoutStopSec=300
Restart=on-failure

[Install]
WantedBy=multi-user.target
UNIT
chmod 600 /etc/systemd/system/gemmax.service  # it holds the server's API key
systemctl daemon-reload
systemctl enable --now gemmax.service
"""
