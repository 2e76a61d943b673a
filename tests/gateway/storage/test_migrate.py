import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, inspect, pool, text
from sqlalchemy.exc import IntegrityError

from gateway.storage.migrate import (
    all_revisions,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from gateway.storage.models import Base

APP_TABLES = {
    "tenants",
    "api_keys",
    "usage_records",
    "scoped_budgets",
    "audit_log",
    "alert_events",
}


def table_names(url: str) -> set[str]:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_every_migration_goes_up_and_down(database_url):
    revisions = all_revisions()
    assert revisions[0] == "0001"
    assert revisions[-1] == head_revision()
    assert current_revision(database_url) is None
    for revision in revisions:
        upgrade(database_url, revision)
        assert current_revision(database_url) == revision
    assert table_names(database_url) == APP_TABLES
    for previous in [*reversed(revisions[:-1]), None]:
        downgrade(database_url, "-1")
        assert current_revision(database_url) == previous
    assert table_names(database_url) == set()
    upgrade(database_url)
    assert current_revision(database_url) == head_revision()
    assert table_names(database_url) == APP_TABLES


def test_models_and_migrations_agree(migrated_url):
    engine = create_engine(migrated_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_the_status_check_constraint_exists(migrated_url):
    engine = create_engine(migrated_url, poolclass=pool.NullPool)
    insert = text(
        "INSERT INTO usage_records (request_id, tenant_id, requested_model, prompt_tokens,"
        " cached_tokens, completion_tokens, cost_micros, status, streamed, created_at)"
        " VALUES ('r', 't', 'm', 0, 0, 0, 0, :status, false, CURRENT_TIMESTAMP)"
    )
    try:
        with engine.begin() as connection:
            connection.execute(insert, {"status": "completed"})
        try:
            with engine.begin() as connection:
                connection.execute(insert, {"status": "lost"})
        except IntegrityError:
            pass
        else:
            raise AssertionError("a status outside the enum was accepted")
    finally:
        engine.dispose()


def test_replicas_starting_together_migrate_once(database_url):
    """Several gateway processes upgrading one empty database at once all succeed."""
    import subprocess
    import sys

    script = "import sys; from gateway.storage.migrate import upgrade; upgrade(sys.argv[1])"
    replicas = [
        subprocess.Popen(
            [sys.executable, "-c", script, database_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [replica.communicate(timeout=120)[0] for replica in replicas]
    assert [replica.returncode for replica in replicas] == [0] * 4, outputs
    assert current_revision(database_url) == head_revision()
    assert table_names(database_url) == APP_TABLES


def test_0002_backfills_model_version_with_the_served_model(database_url):
    """Rows from before rollouts were served by their served model: 0002 says so."""
    upgrade(database_url, "0001")
    engine = create_engine(database_url, poolclass=pool.NullPool)
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO usage_records (request_id, tenant_id, requested_model,"
                    " served_model, prompt_tokens, cached_tokens, completion_tokens,"
                    " cost_micros, status, streamed, created_at) VALUES"
                    " ('r1', 't', 'auto', 'large', 1, 0, 1, 3, 'completed', false,"
                    " CURRENT_TIMESTAMP), ('r2', 't', 'nope', NULL, 0, 0, 0, 0, 'rejected',"
                    " false, CURRENT_TIMESTAMP)"
                )
            )
        upgrade(database_url, "0002")
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT request_id, model_version FROM usage_records ORDER BY request_id")
            ).all()
        assert [tuple(row) for row in rows] == [("r1", "large"), ("r2", None)]
        downgrade(database_url, "0001")
        assert "model_version" not in {
            column["name"] for column in inspect(engine).get_columns("usage_records")
        }
    finally:
        engine.dispose()


def usage_columns(engine: Engine) -> set[str]:
    return {column["name"] for column in inspect(engine).get_columns("usage_records")}


def test_0003_adds_finish_reason_null_for_rows_before_it(database_url):
    """Rows from before 0003 never had their finish reason recorded: null, not a guess."""
    upgrade(database_url, "0002")
    engine = create_engine(database_url, poolclass=pool.NullPool)
    insert = (
        "INSERT INTO usage_records (request_id, tenant_id, requested_model, prompt_tokens,"
        " cached_tokens, completion_tokens, cost_micros, status, streamed, created_at{column})"
        " VALUES (:request_id, 't', 'm', 1, 0, 1, 3, 'completed', false, CURRENT_TIMESTAMP"
        "{value})"
    )
    try:
        with engine.begin() as connection:
            connection.execute(text(insert.format(column="", value="")), {"request_id": "before"})
        upgrade(database_url, "0003")
        with engine.begin() as connection:
            connection.execute(
                text(insert.format(column=", finish_reason", value=", :finish_reason")),
                {"request_id": "after", "finish_reason": "tool_calls"},
            )
            rows = connection.execute(
                text("SELECT request_id, finish_reason FROM usage_records ORDER BY id")
            ).all()
        assert [tuple(row) for row in rows] == [("before", None), ("after", "tool_calls")]
        downgrade(database_url, "0002")
        assert "finish_reason" not in usage_columns(engine)
        with engine.connect() as connection:
            ids = connection.execute(text("SELECT request_id FROM usage_records ORDER BY id"))
            assert [row[0] for row in ids] == ["before", "after"]  # the rows stay
    finally:
        engine.dispose()


def test_0004_makes_tenant_ids_unique_regardless_of_case(database_url):
    """Ids differing only in case from before 0004 stop the upgrade, named, and nothing is
    renamed; once an operator resolves them the index refuses new case variants."""
    upgrade(database_url, "0003")
    engine = create_engine(database_url, poolclass=pool.NullPool)
    insert = text(
        "INSERT INTO tenants (id, name, tier, quota, created_at, updated_at)"
        " VALUES (:id, '', 'free', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
    )
    try:
        with engine.begin() as connection:
            for tenant_id in ("acme", "Acme", "other"):
                connection.execute(insert, {"id": tenant_id})
        with pytest.raises(RuntimeError, match="differ only in case") as raised:
            upgrade(database_url, "0004")
        assert sorted(str(raised.value).rsplit(": ", 1)[1].split(", ")) == ["Acme", "acme"]
        assert current_revision(database_url) == "0003"
        with engine.begin() as connection:
            connection.execute(text("UPDATE tenants SET id = 'acme-2' WHERE id = 'Acme'"))
        upgrade(database_url, "0004")
        with pytest.raises(IntegrityError), engine.begin() as connection:
            connection.execute(insert, {"id": "OTHER"})
        downgrade(database_url, "0003")
        with engine.begin() as connection:
            connection.execute(insert, {"id": "OTHER"})
    finally:
        engine.dispose()


def test_0005_adds_scoped_budgets_and_the_end_user_on_usage_records(database_url):
    """Rows from before 0005 have no end user (null); a scoped budget names its scope, unit
    and period from a closed set; the downgrade keeps the usage rows."""
    upgrade(database_url, "0004")
    engine = create_engine(database_url, poolclass=pool.NullPool)
    usage = (
        "INSERT INTO usage_records (request_id, tenant_id, requested_model, prompt_tokens,"
        " cached_tokens, completion_tokens, cost_micros, status, streamed, created_at{column})"
        " VALUES (:request_id, 't', 'm', 1, 0, 1, 3, 'completed', false, CURRENT_TIMESTAMP"
        "{value})"
    )
    budget = text(
        "INSERT INTO scoped_budgets (tenant_id, scope, subject, unit, amount, period,"
        " created_at, updated_at) VALUES ('t', :scope, 'alice', :unit, 5, 'day',"
        " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
    )
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO tenants (id, name, tier, quota, created_at, updated_at)"
                    " VALUES ('t', '', 'free', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            connection.execute(text(usage.format(column="", value="")), {"request_id": "before"})
        upgrade(database_url, "0005")
        with engine.begin() as connection:
            connection.execute(
                text(usage.format(column=", end_user", value=", :end_user")),
                {"request_id": "after", "end_user": "alice"},
            )
            connection.execute(budget, {"scope": "user", "unit": "micros"})
            rows = connection.execute(
                text("SELECT request_id, end_user FROM usage_records ORDER BY id")
            ).all()
        assert [tuple(row) for row in rows] == [("before", None), ("after", "alice")]
        for scope, unit in (("team", "tokens"), ("key", "usd")):
            with pytest.raises(IntegrityError), engine.begin() as connection:
                connection.execute(budget, {"scope": scope, "unit": unit})
        index_names = {index["name"] for index in inspect(engine).get_indexes("usage_records")}
        assert {
            "ix_usage_records_tenant_id_end_user_created_at",
            "ix_usage_records_key_id_created_at",
        } <= index_names
        downgrade(database_url, "0004")
        assert "end_user" not in usage_columns(engine)
        assert "scoped_budgets" not in table_names(database_url)
        with engine.connect() as connection:
            ids = connection.execute(text("SELECT request_id FROM usage_records ORDER BY id"))
            assert [row[0] for row in ids] == ["before", "after"]
    finally:
        engine.dispose()
