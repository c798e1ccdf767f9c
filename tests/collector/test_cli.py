"""`art-collector serve`: flags override environment settings."""

from __future__ import annotations

import socket
import sqlite3
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from collector import cli
from collector.env_names import exit_on_unknown_env
from collector.schema import SCHEMA_VERSION
from collector.store import SqlStore
from examples.stack import free_port
from tests.collector.services import PostgresServer


@pytest.fixture(autouse=True)
def _port_nothing_listens_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` refuses a port it cannot listen on (4318 may be taken where the tests run); a flag overrides."""
    monkeypatch.setenv("ART_COLLECTOR_PORT", str(free_port()))


def _never_serve(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Fail the test, saying `why`, when `serve` would start serving."""
    monkeypatch.setattr("collector.listen.serve_on", lambda server, sock: pytest.fail(why))


def test_serve_flags_override_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: dict[str, Any] = {}
    port = free_port()
    monkeypatch.setattr("collector.listen.serve_on", lambda server, sock: calls.update(
        app=server.config.app, host=server.config.host, port=server.config.port, bound=sock.getsockname()))
    monkeypatch.setenv("ART_COLLECTOR_PORT", "5000")
    monkeypatch.setenv("ART_COLLECTOR_HOST", "0.0.0.0")
    monkeypatch.setenv("ART_COLLECTOR_MIN_GROUP_SIZE", "4")
    cli.main(["serve", "--port", str(port), "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    assert (calls["host"], calls["port"]) == calls["bound"] == ("0.0.0.0", port)
    settings = calls["app"].state.settings
    assert settings.min_group_size == 4 and settings.db.endswith("x.db")
    assert (tmp_path / "x.db").exists()


def test_default_db_lives_in_art_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from collector.config import CollectorSettings

    monkeypatch.setenv("ART_HOME", str(tmp_path))
    monkeypatch.setenv("API_KEY", "not-ours")
    settings = CollectorSettings()
    assert settings.db == f"sqlite:///{tmp_path / 'collector.db'}"
    assert settings.api_key is None
    monkeypatch.setenv("ART_API_KEY", "k")
    assert CollectorSettings().api_key.get_secret_value() == "k"
    monkeypatch.setenv("ART_COLLECTOR_API_KEY", "collector-only")  # one shared key, as for the trainer
    with pytest.raises(ValueError, match="ART_COLLECTOR_API_KEY is not read: the API key is ART_API_KEY"):
        CollectorSettings()


@pytest.mark.parametrize("name", ["art_collector_api_key", "Art_Collector_Api_Key"])
def test_the_collectors_prefixed_key_name_is_refused_in_any_case(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """pydantic-settings reads the key by its field name too, in any case: only the upper-case name was refused, so
    `art_collector_api_key` silently became the key the collector demands, one the plugin and trainer do not send."""
    from collector.config import CollectorSettings

    monkeypatch.setenv(name, "collector-only")
    with pytest.raises(ValueError, match=f"{name} is not read: the API key is ART_API_KEY.* unset {name}\\."):
        CollectorSettings()


def test_bad_settings_exit_with_one_line_each(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _never_serve(monkeypatch, "served with bad settings")
    monkeypatch.setenv("ART_COLLECTOR_PORT", "abc")
    with pytest.raises(SystemExit) as info:
        cli.main(["serve"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "art-collector: error: port='abc': Input should be a valid integer" in err
    assert "Traceback" not in err and "errors.pydantic.dev" not in err


def test_bad_judge_settings_exit_naming_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _never_serve(monkeypatch, "served with bad settings")
    monkeypatch.setenv("ART_COLLECTOR_JUDGE_ON_FAILURE", "bogus")
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "art-collector: error: JudgeSettings: on_failure='bogus': Input should be" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("host", "says"), [
    ("127.0.0.1", "Address already in use"),
    ("192.0.2.1", "Cannot assign requested address"),  # TEST-NET-1: no interface of this machine
])
def test_an_address_that_cannot_be_listened_on_exits_naming_it(host: str, says: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Was uvicorn's "address already in use" (no flag named, status 3) once the store was migrated and the app up."""
    _never_serve(monkeypatch, "served on an address it cannot listen on")
    with socket.create_server(("127.0.0.1", 0)) as held, pytest.raises(SystemExit) as info:
        port = held.getsockname()[1]
        cli.main(["serve", "--host", host, "--port", str(port), "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"art-collector: error: host={host!r} port={port}: cannot listen there ({says}); " in err
    assert "--port (ART_COLLECTOR_PORT) or --host (ART_COLLECTOR_HOST)" in err


def test_a_server_that_takes_the_port_while_the_store_opens_stops_the_start(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A server binding with `SO_REUSEADDR` may bind beside the collector's port before it listens: the collector
    then seemed up while the other took its connections."""
    from collector import server

    _never_serve(monkeypatch, "served on a port another server took")
    port = free_port()
    real_create_app = server.create_app
    with ExitStack() as taken, pytest.raises(SystemExit) as info:
        def create_app(*args: Any) -> Any:
            taken.enter_context(socket.create_server(("127.0.0.1", port)))  # while the store migrates
            return real_create_app(*args)

        monkeypatch.setattr(server, "create_app", create_app)
        cli.main(["serve", "--port", str(port), "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"host='127.0.0.1' port={port}: another program took the port while the service started" in err


def test_serve_needs_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_reward_weights_that_are_not_json_exit_naming_the_form(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Said only "Input should be a valid dictionary" for `correct=1`, not that the variable takes JSON."""
    _never_serve(monkeypatch, "served with bad settings")
    monkeypatch.setenv("ART_COLLECTOR_REWARD_WEIGHTS", "correct=1")
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "reward_weights='correct=1': Input should be a valid dictionary: the text is not JSON; give a JSON" in err


def test_reward_weights_from_env_and_conflicts(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from collector.config import CollectorSettings

    monkeypatch.setenv("ART_COLLECTOR_REWARD_WEIGHTS", '{"correct":1,"short":0.5}')
    settings = CollectorSettings()
    assert settings.training_reward.of({"correct": 1.0, "short": 0.5}) == 1.25
    monkeypatch.setenv("ART_COLLECTOR_REWARD_NAME", "correct")
    with pytest.raises(ValidationError, match="set one"):
        CollectorSettings()
    monkeypatch.delenv("ART_COLLECTOR_REWARD_NAME")
    monkeypatch.setenv("ART_COLLECTOR_REWARD_WEIGHTS", '{"correct": NaN}')
    with pytest.raises(ValidationError):
        CollectorSettings()


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("ART_COLLECTOR_IDLE_SECONDS", "inf", "idle_seconds='inf': Input should be a finite number"),
        ("ART_COLLECTOR_GROUP_TIMEOUT_SECONDS", "Infinity",
         "group_timeout_seconds='Infinity': Input should be a finite number"),
        ("ART_COLLECTOR_REWARD_WEIGHTS", '{"correct": Infinity}',
         "reward_weights.correct=inf: Input should be a finite number"),
        ("ART_COLLECTOR_JUDGE_TIMEOUT_SECONDS", "inf",
         "JudgeSettings: timeout_seconds='inf': Input should be a finite number"),
        ("ART_COLLECTOR_LANGFUSE_SYNC_SECONDS", "inf",
         "LangfuseSettings: sync_seconds='inf': Input should be a finite number"),
    ],
)
def test_non_finite_settings_exit_naming_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              variable: str, value: str, says: str) -> None:
    """inf passed every `gt=0` bound: an idle time of inf never completed a trajectory, a judge timeout of inf hung."""
    _never_serve(monkeypatch, "served with bad settings")
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"art-collector: error: {says}" in err, err
    assert "Traceback" not in err



@pytest.mark.parametrize(
    ("variables", "says"),
    [
        ({"ART_COLLECTOR_JUDGE_URL": "localhost:8000/v1"},
         "JudgeSettings: url='localhost:8000/v1': needs http:// or https:// and a host, e.g. http://localhost:8000/v1"),
        ({"ART_TRAINER_URL": "http://"}, "JudgeSettings: url='http://': needs http:// or https:// and a host"),
        ({"LANGFUSE_HOST": "cloud.langfuse.com", "LANGFUSE_PUBLIC_KEY": "pk", "LANGFUSE_SECRET_KEY": "sk"},
         "LangfuseSettings: ART_COLLECTOR_LANGFUSE_HOST='cloud.langfuse.com': needs http:// or https:// and a host"),
    ],
)
def test_a_service_address_that_is_no_http_url_exits_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], variables: dict[str, str],
    says: str
) -> None:
    """They were accepted, and then every judge run or Langfuse sync failed, long after the start."""
    _never_serve(monkeypatch, "served with bad settings")
    for variable, value in variables.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"art-collector: error: {says}" in err, err

@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("/srv/collector.db", "Could not parse SQLAlchemy URL"),
        ("postgres://u@db/x", "Can't load plugin: sqlalchemy.dialects:postgres"),
        ("mysql://u@db/x", "No module named 'MySQLdb'"),
    ],
)
def test_a_db_url_that_cannot_be_opened_exits_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], url: str, says: str
) -> None:
    """A URL SQLAlchemy cannot open left `serve` with a traceback from `create_engine`."""
    _never_serve(monkeypatch, "served with bad settings")
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--db", url])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"art-collector: error: db={url!r}: not a database URL" in err and says in err, err
    assert "Traceback" not in err


def _serve_refused(capsys: pytest.CaptureFixture[str], db: str) -> str:
    """The `error:` line `serve --db db` exits with (code 2, no traceback)."""
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--db", db])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    return err.splitlines()[-1]


FIX = "start the database or correct --db (env ART_COLLECTOR_DB)"


def test_a_store_on_a_full_disk_exits_saying_to_free_space(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It said to start the database or correct --db, neither of which helps."""

    def full(self: SqlStore) -> None:
        raise OperationalError("CREATE TABLE groups", {}, sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(SqlStore, "setup", full)
    db = f"sqlite:///{tmp_path / 'c.db'}"
    line = _serve_refused(capsys, db)
    assert line == f"art-collector: error: db={db!r}: cannot open the store (database or disk is full); free disk space"


def test_a_database_that_refuses_the_connection_exits_naming_it_without_its_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that is down ended `serve` with an OperationalError traceback from `store.setup()`."""
    _never_serve(monkeypatch, "served without a store")
    port = free_port()
    line = _serve_refused(capsys, f"postgresql+psycopg://u:secret@127.0.0.1:{port}/x")
    said = f"db='postgresql+psycopg://u:***@127.0.0.1:{port}/x': cannot open the store (connection failed: "
    assert line.startswith(f"art-collector: error: {said}connection to server at \"127.0.0.1\", port {port}"), line
    assert "Connection refused" in line and line.endswith(f"); {FIX}") and "secret" not in line


def test_a_missing_database_exits_naming_it_without_its_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], postgres: PostgresServer
) -> None:
    _never_serve(monkeypatch, "served without a store")
    url = postgres.url("nosuch").replace("postgres@", "postgres:secret@")  # the test server trusts any password
    line = _serve_refused(capsys, url)
    assert line == (f"art-collector: error: db='{url.replace(':secret@', ':***@')}': cannot open the store "
                    f"(connection failed: connection to server at \"127.0.0.1\", port {postgres.port} failed: FATAL:  "
                    f"database \"nosuch\" does not exist); {FIX}"), line


@pytest.mark.parametrize(
    ("in_the_way", "path", "reason"),
    [
        ("file", "blocker/sub/collector.db", "[Errno 20] Not a directory: '{tmp}/blocker/sub'"),  # folder not made
        ("folder", "blocker", "unable to open database file"),  # a folder where the file goes
    ],
)
def test_a_sqlite_file_that_cannot_be_made_exits_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    in_the_way: str, path: str, reason: str,
) -> None:
    """`make_engine`'s mkdir raised NotADirectoryError, sqlite3 an OperationalError: both a traceback."""
    _never_serve(monkeypatch, "served without a store")
    blocker = tmp_path / "blocker"
    blocker.mkdir() if in_the_way == "folder" else blocker.write_text("not a folder")
    db = f"sqlite:///{tmp_path / path}"
    line = _serve_refused(capsys, db)
    assert line == f"art-collector: error: db={db!r}: cannot open the store ({reason.format(tmp=tmp_path)}); {FIX}"


@pytest.mark.parametrize("through", ["flag", "env"])
def test_a_file_that_is_not_a_database_exits_naming_it_and_is_left_as_it_was(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, through: str
) -> None:
    """sqlite3's DatabaseError (not an OperationalError) from `PRAGMA journal_mode=WAL` ended `serve` with a
    traceback."""
    _never_serve(monkeypatch, "served without a store")
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes, not a database\n" * 200)
    db = f"sqlite:///{notes}"
    monkeypatch.setenv("ART_COLLECTOR_DB", db)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--db", db] if through == "flag" else ["serve"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    said = f"art-collector: error: db={db!r}: cannot open the store (file is not a database); {FIX}"
    assert err.splitlines()[-1] == said
    assert notes.read_bytes() == b"my notes, not a database\n" * 200 and sorted(tmp_path.iterdir()) == [notes]


def test_a_database_of_a_newer_collector_exits_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`migrate`'s RuntimeError ended `serve` with a traceback."""
    from collector.config import CollectorSettings
    from collector.schema import SCHEMA_VERSION, schema_version
    from collector.store import SqlStore

    _never_serve(monkeypatch, "served on a schema it does not know")
    db = f"sqlite:///{tmp_path / 'collector.db'}"
    store = SqlStore(CollectorSettings(db=db))
    store.setup()
    with store.engine.begin() as conn:
        conn.execute(schema_version.insert().values(version=SCHEMA_VERSION + 1, applied_at=0.0))
    store.close()
    assert _serve_refused(capsys, db) == (f"art-collector: error: db={db!r}: database schema is version "
                                          f"{SCHEMA_VERSION + 1}, newer than this collector ({SCHEMA_VERSION}); "
                                          "upgrade art-langgraph")


def test_a_database_with_another_applications_table_exits_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The collector altered the other application's `rewards` table and served on it (503 to every reward)."""
    import sqlite3

    _never_serve(monkeypatch, "served on another application's table")
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE rewards (who TEXT, amount INTEGER)")
    db = f"sqlite:///{path}"
    line = _serve_refused(capsys, db)
    assert line == f"art-collector: error: db={db!r}: cannot open the store (table rewards already exists); {FIX}"


@pytest.mark.parametrize("journal", ["delete", "wal"])
@pytest.mark.parametrize("made_by", ["another application", "a newer collector"])
def test_a_refused_sqlite_file_keeps_its_bytes_and_journal_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, made_by: str, journal: str
) -> None:
    """The engine ran `PRAGMA journal_mode=WAL` on connect, before `migrate` refused the file: a lasting change to a
    file that is not the collector's, though its tables and rows were left as they were."""
    _never_serve(monkeypatch, "served on a database it refused")
    path = tmp_path / "app.db"
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(f"PRAGMA journal_mode={journal}")
        if made_by == "another application":
            conn.execute("CREATE TABLE rewards (who TEXT, amount INTEGER)")
        else:
            conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at FLOAT NOT NULL)")
            conn.execute("INSERT INTO schema_version VALUES (?, 0.0)", (SCHEMA_VERSION + 1,))
    before = path.read_bytes()
    _serve_refused(capsys, f"sqlite:///{path}")
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]  # no -wal, -shm or -journal left
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == journal


def test_a_bad_db_setting_is_reported_without_its_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`settings_error` printed `db='nosuch://u:secret@h/x'` on stderr."""
    _never_serve(monkeypatch, "served with bad settings")
    line = _serve_refused(capsys, "nosuch://u:secret@h/x")
    assert line.startswith("art-collector: error: db='nosuch://u:***@h/x': not a database URL SQLAlchemy can open")
    assert "secret" not in line


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("postgresql+psycopg://u:p%40ss@db:5432/x?sslmode=require", "postgresql+psycopg://u:***@db:5432/x?sslmode=require"),
        ("http://:key@collector:4318", "http://:***@collector:4318"),
        ("http://judge:hun@ter2@judge.local:9/v1", "http://judge:***@judge.local:9/v1"),  # all httpx sends as password
        ("https://u@judge.local/v1", "https://u@judge.local/v1"),
        # no parser reads them (a bad port): refused at start, in a line that names the value
        ("https://judge:s3cret@judge.example:80a/v1", "https://judge:***@judge.example:80a/v1"),
        ("postgresql+psycopg://u:s3cr@t@db:5432x/x", "postgresql+psycopg://u:***@db:5432x/x"),
        ("http://judge.example:80a/v1", "http://judge.example:80a/v1"),  # no password: as it is
        ("postgresql+psycopg://u@db/x", "postgresql+psycopg://u@db/x"),  # no password: as it is
        ("sqlite:////srv/collector.db", "sqlite:////srv/collector.db"),
        ("/srv/collector.db", "/srv/collector.db"),  # not a URL
        ("abc", "abc"),
    ],
)
def test_hide_password_hides_only_a_url_password(value: str, shown: str) -> None:
    from collector.config import hide_password

    assert hide_password(value) == shown


def test_serve_help_names_every_variable_serve_reads_and_the_log_levels_default(
        capsys: pytest.CaptureFixture[str]) -> None:
    from collector.config import CollectorSettings
    from collector.scoring_config import JudgeSettings, LangfuseSettings

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    own = [f"ART_COLLECTOR_{name.upper()}" for name, info in CollectorSettings.model_fields.items()
           if info.validation_alias is None]
    prefixes = [f"{settings.model_config['env_prefix']}*" for settings in (JudgeSettings, LangfuseSettings)]
    assert [name for name in [*own, "ART_API_KEY", *prefixes] if name not in text] == []  # the judge's were missing
    assert "log level of the collector and uvicorn (default info;" in " ".join(text.split())


def test_a_variable_no_setting_reads_stops_serve_naming_the_closest(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """pydantic-settings ignores a variable under a settings prefix that names no field: the judge kept its 3 tries
    and the store its default file, silently. Another component's variables, the test suite's too, are no error."""
    _never_serve(monkeypatch, "served with a misspelled variable")
    monkeypatch.setattr("collector.store.SqlStore", lambda settings: pytest.fail("opened the store"))
    monkeypatch.setenv("ART_COLLECTOR_JUDGE_ATTEMPT", "5")
    monkeypatch.setenv("ART_COLLECTOR_DB_URL", "sqlite:///elsewhere.db")
    monkeypatch.setenv("ART_BUILD_ID", "42")  # another tool's: warned about, no error
    for name, value in [("ART_COLLECTOR_URL", "http://localhost:4318"), ("ART_TRAINER_LORA_R", "16"),
                        ("ART_TEST_STACK", "http://localhost:4318,http://localhost:8000/v1")]:
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "art-collector: warning: ART_BUILD_ID is set, but no setting reads it" in err
    assert err.splitlines()[-1] == (
        "art-collector: error: ART_COLLECTOR_DB_URL (did you mean ART_COLLECTOR_URL or ART_COLLECTOR_DB?), "
        "ART_COLLECTOR_JUDGE_ATTEMPT (did you mean ART_COLLECTOR_JUDGE_ATTEMPTS or ART_COLLECTOR_JUDGE_AUTO?) are set, "
        "but no setting reads them: rename or unset them (the README lists every ART_* variable)")


def test_an_unknown_variable_outside_the_services_prefixes_is_only_warned_about(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Another tool's `ART_BUILD_ID` must not stop a service; a misspelled plugin variable is told, not refused."""
    exit_on_unknown_env(cli.build_parser(), {"ART_BUILD_ID": "42", "ART_MODLE": "agent@latest", "ART_HOME": "/tmp"})
    err = capsys.readouterr().err
    assert err.startswith("art-collector: warning: ART_BUILD_ID, ART_MODLE (did you mean ART_MODEL?) are set")


def test_a_variable_no_setting_reads_stops_serve_in_lower_case_too(capsys: pytest.CaptureFixture[str]) -> None:
    """pydantic-settings reads `art_collector_port` as `ART_COLLECTOR_PORT`: a misspelling in lower case was ignored
    as silently as one in upper case, and only upper-case names were checked."""
    environ = {"art_collector_judge_attempt": "5", "art_collector_port": "4318", "art_model": "agent@latest",
               "art_build_id": "42"}
    with pytest.raises(SystemExit) as info:
        exit_on_unknown_env(cli.build_parser(), environ)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "art-collector: warning: art_build_id is set, but no setting reads it" in err
    assert err.splitlines()[-1] == (
        "art-collector: error: art_collector_judge_attempt (did you mean ART_COLLECTOR_JUDGE_ATTEMPTS or "
        "ART_COLLECTOR_JUDGE_AUTO?) is set, but no setting reads it: rename or unset it (the README lists every ART_* "
        "variable)")
