"""`art-collector`: command line of the collector service."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

__all__ = ["main"]

_EPILOG = """\
environment (flags override):
  ART_COLLECTOR_HOST, ART_COLLECTOR_PORT, ART_COLLECTOR_DB, ART_COLLECTOR_MIN_GROUP_SIZE,
  ART_COLLECTOR_REWARD_NAME, ART_COLLECTOR_REWARD_WEIGHTS (JSON, e.g. '{"correct":1,"short":0.5}'),
  ART_COLLECTOR_GROUP_TIMEOUT_SECONDS, ART_COLLECTOR_KEEP_ZERO_SPREAD, ART_COLLECTOR_MAX_FAILED_ATTEMPTS,
  ART_COLLECTOR_IDLE_SECONDS, ART_COLLECTOR_MAX_BODY_BYTES, ART_API_KEY (write endpoints then need a Bearer token),
  ART_HOME (folder of the default SQLite file, default ~/.cache/art-langgraph),
  ART_COLLECTOR_JUDGE_* (the RULER judge) and ART_COLLECTOR_LANGFUSE_* (the Langfuse sync): see the README
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `art-collector`."""
    parser = argparse.ArgumentParser(
        prog="art-collector",
        description="Collect OpenTelemetry traces of agent runs into scored trajectories and lease them to a trainer.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the collector's HTTP API (OTLP/HTTP on /v1/traces)",
        description="Run the collector: OTLP/HTTP receiver, reward API, batch leases, read API.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--host", help="interface to listen on (default 127.0.0.1; env ART_COLLECTOR_HOST)")
    serve.add_argument("--port", type=int, help="port to listen on (default 4318; env ART_COLLECTOR_PORT)")
    serve.add_argument(
        "--db",
        help=(
            "SQLAlchemy database URL: sqlite:///FILE or postgresql+psycopg://USER:PASS@HOST:PORT/DB "
            "(default sqlite:///$ART_HOME/collector.db; env ART_COLLECTOR_DB)"
        ),
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log level of the collector and uvicorn (default %(default)s; a flag only, with no "
                       "environment variable)")
    return parser


def _store_refused(url: str, reason: str) -> str:
    """The `error:` line of a store `serve` cannot open: the URL (its password hidden), the reason and the fix."""
    from collector.config import hide_password

    full = any(sign in reason.lower() for sign in ("disk is full", "no space left"))  # SQLite's, PostgreSQL's words
    fix = "free disk space" if full else "start the database or correct --db (env ART_COLLECTOR_DB)"
    return f"db={hide_password(url)!r}: cannot open the store ({reason}); {fix}"


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `art-collector` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    import uvicorn
    from pydantic import ValidationError
    from sqlalchemy.exc import DatabaseError

    from collector.config import CollectorSettings, hide_password, settings_error
    from collector.engine import driver_reason
    from collector.env_names import exit_on_unknown_env
    from collector.listen import AnnouncedServer, bind_address, serve_on, start_listening
    from collector.schema import SchemaTooNew
    from collector.server import create_app
    from collector.store import SqlStore

    exit_on_unknown_env(parser)  # a misspelled ART_* variable, which the settings would ignore
    overrides = {name: getattr(args, name) for name in ("host", "port", "db") if getattr(args, name) is not None}
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fix = "free that port, or give another --port (ART_COLLECTOR_PORT) or --host (ART_COLLECTOR_HOST)"
    try:
        settings = CollectorSettings(**overrides)
        sock = bind_address(settings.host, settings.port, fix)
    except ValidationError as exc:
        parser.error(settings_error(exc))
    except ValueError as exc:  # the address cannot be listened on
        parser.error(str(exc))
    with sock:  # closed on every refusal below; `serve_on` closes it once the server stops
        try:
            store = SqlStore(settings)  # makes the folder of a SQLite file
        except OSError as exc:  # that folder cannot be made (a file is in the way, no permission)
            parser.error(_store_refused(settings.db, str(exc)))
        try:
            app = create_app(settings, store)  # migrates the store, then reads the judge's and Langfuse's settings
        except ValidationError as exc:  # ART_COLLECTOR_JUDGE_*, ART_COLLECTOR_LANGFUSE_*
            refusal = f"{exc.title}: {settings_error(exc)}"
        except DatabaseError as exc:  # from the migration, the only database work here: down, refused, wrong login,
            refusal = _store_refused(settings.db, driver_reason(exc))  # not an SQLite file, another app's table
        except SchemaTooNew as exc:
            refusal = f"db={hide_password(settings.db)!r}: {exc}"
        else:
            try:
                start_listening(sock, fix)
            except ValueError as exc:
                refusal = str(exc)
            else:
                config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level)
                serve_on(AnnouncedServer(config), sock)
                return
        store.close()  # no connection left open on a file it refused (nor, on a WAL file, the -wal and -shm beside it)
        parser.error(refusal)


if __name__ == "__main__":
    main()
