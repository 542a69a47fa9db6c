"""Initial schema: hardware, workloads, studies, trials, best

Revision ID: 0001
Revises: (none: the first schema)
Create Date: 2026-11-22 13:47:01.508663
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _create_hardware()
    _create_workloads()
    _create_studies()
    _create_trials()
    _create_best()


def _create_hardware() -> None:
    op.create_table('advisor_hardware',
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('fingerprint', name=op.f('pk_advisor_hardware'))
    )


def _create_workloads() -> None:
    op.create_table('advisor_workloads',
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('description', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('fingerprint', name=op.f('pk_advisor_workloads'))
    )


def _create_studies() -> None:
    op.create_table('advisor_studies',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('workload_fp', sa.String(length=64), nullable=False),
    sa.Column('hardware_fp', sa.String(length=64), nullable=False),
    sa.Column('space', sa.JSON(), nullable=False),
    sa.Column('objective', sa.JSON(), nullable=False),
    sa.Column('software', sa.JSON(), nullable=False),
    sa.Column('software_fp', sa.String(length=64), nullable=False),
    sa.Column('optuna_study_name', sa.String(length=200), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('running', 'finished', 'failed')", name=op.f('ck_advisor_studies_status')),
    sa.ForeignKeyConstraint(['hardware_fp'], ['advisor_hardware.fingerprint'],
        name=op.f('fk_advisor_studies_hardware_fp_advisor_hardware')),
    sa.ForeignKeyConstraint(['workload_fp'], ['advisor_workloads.fingerprint'],
        name=op.f('fk_advisor_studies_workload_fp_advisor_workloads')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_advisor_studies')),
    sa.UniqueConstraint('name', name=op.f('uq_advisor_studies_name'))
    )
    with op.batch_alter_table('advisor_studies', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_advisor_studies_hardware_fp'), ['hardware_fp'], unique=False)
        batch_op.create_index(batch_op.f('ix_advisor_studies_workload_fp'), ['workload_fp'], unique=False)


def _create_trials() -> None:
    op.create_table('advisor_trials',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('study_id', sa.Integer(), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('config_hash', sa.String(length=64), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('owner', sa.String(length=200), nullable=False),
    sa.Column('software_fp', sa.String(length=64), nullable=False),
    sa.Column('samples_per_s', sa.Float(), nullable=True),
    sa.Column('tokens_per_s', sa.Float(), nullable=True),
    sa.Column('step_p50_s', sa.Float(), nullable=True),
    sa.Column('step_p90_s', sa.Float(), nullable=True),
    sa.Column('peak_memory_bytes', sa.BigInteger(), nullable=True),
    sa.Column('predicted_memory_bytes', sa.BigInteger(), nullable=True),
    sa.Column('data_wait_fraction', sa.Float(), nullable=True),
    sa.Column('mfu', sa.Float(), nullable=True),
    sa.Column('bottleneck', sa.String(length=32), nullable=True),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('estimate', sa.JSON(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('ok', 'oom', 'timeout', 'crashed', 'error', 'invalid', 'pruned', 'interrupted', "
                       "'running')",
        name=op.f('ck_advisor_trials_status')),
    sa.CheckConstraint('attempt >= 1', name=op.f('ck_advisor_trials_attempt')),
    sa.ForeignKeyConstraint(['study_id'], ['advisor_studies.id'],
        name=op.f('fk_advisor_trials_study_id_advisor_studies'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_advisor_trials')),
    sa.UniqueConstraint('study_id', 'config_hash', 'attempt', name='uq_advisor_trials_claim')
    )
    with op.batch_alter_table('advisor_trials', schema=None) as batch_op:
        batch_op.create_index('ix_advisor_trials_reuse', ['config_hash', 'software_fp'], unique=False)
        batch_op.create_index(batch_op.f('ix_advisor_trials_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_advisor_trials_study_id'), ['study_id'], unique=False)


def _create_best() -> None:
    op.create_table('advisor_best',
    sa.Column('workload_fp', sa.String(length=64), nullable=False),
    sa.Column('hardware_fp', sa.String(length=64), nullable=False),
    sa.Column('objective', sa.String(length=200), nullable=False),
    sa.Column('trial_id', sa.Integer(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['hardware_fp'], ['advisor_hardware.fingerprint'],
        name=op.f('fk_advisor_best_hardware_fp_advisor_hardware')),
    sa.ForeignKeyConstraint(['trial_id'], ['advisor_trials.id'],
        name=op.f('fk_advisor_best_trial_id_advisor_trials'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['workload_fp'], ['advisor_workloads.fingerprint'],
        name=op.f('fk_advisor_best_workload_fp_advisor_workloads')),
    sa.PrimaryKeyConstraint('workload_fp', 'hardware_fp', 'objective', name=op.f('pk_advisor_best'))
    )


def downgrade() -> None:
    op.drop_table('advisor_best')
    with op.batch_alter_table('advisor_trials', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_advisor_trials_study_id'))
        batch_op.drop_index(batch_op.f('ix_advisor_trials_status'))
        batch_op.drop_index('ix_advisor_trials_reuse')

    op.drop_table('advisor_trials')
    with op.batch_alter_table('advisor_studies', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_advisor_studies_workload_fp'))
        batch_op.drop_index(batch_op.f('ix_advisor_studies_hardware_fp'))

    op.drop_table('advisor_studies')
    op.drop_table('advisor_workloads')
    op.drop_table('advisor_hardware')
