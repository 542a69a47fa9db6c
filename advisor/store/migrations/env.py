"""Alembic environment for the advisor's store. Called by advisor.store.migrate with an open
connection in config.attributes; Optuna's tables in the same database are invisible here."""

from __future__ import annotations

from alembic import context

from advisor.store.migrate import VERSION_TABLE, include_name
from advisor.store.models import Base


def _configure(**kw) -> None:
    context.configure(target_metadata=Base.metadata, version_table=VERSION_TABLE, include_name=include_name,
                      render_as_batch=True, compare_type=True, **kw)


def run() -> None:
    config = context.config
    connection = config.attributes.get("connection")
    if context.is_offline_mode():  # `--sql`: emit the DDL for a URL without connecting
        _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    if connection is None:
        from advisor.store.engine import make_engine, resolve_url

        engine = make_engine(resolve_url(config.get_main_option("sqlalchemy.url")))
        with engine.begin() as conn:
            _configure(connection=conn)
            with context.begin_transaction():
                context.run_migrations()
        engine.dispose()
        return
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


run()
