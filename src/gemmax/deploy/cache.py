"""The compile cache at a URL: a check that the URL's filesystem is installed, with the fix.

fsspec resolves `s3://` to s3fs only when s3fs is installed; without it the import fails deep in
fsspec, which an MCP client sees as an opaque crash. `check_url` fails first with what to install.
"""

from __future__ import annotations

from gemmax.deploy.errors import DeployError

EXTRA = {"s3": "aws", "s3a": "aws"}


def check_url(url: str) -> None:
    """DeployError naming the package (and gemmax extra) a URL's filesystem needs, if it is missing."""
    if "://" not in url or url.startswith("file://"):
        return
    protocol = url.split("://", 1)[0]
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        extra = EXTRA.get(protocol)
        hint = f"pip install 'gemmax[{extra}]'" if extra else "install the fsspec filesystem package for it"
        raise DeployError(f"{protocol}:// URLs need a filesystem package that is not installed ({exc}); {hint}") from None
    except ValueError as exc:
        raise DeployError(f"{url!r}: unknown protocol {protocol!r} ({exc})") from None
