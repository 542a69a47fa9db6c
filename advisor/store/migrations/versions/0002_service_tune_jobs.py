"""Service tune jobs: the queue behind POST /v1/tune, claimed by workers

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 16:35:19.278266
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('advisor_jobs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('request', sa.JSON(), nullable=False),
    sa.Column('devices', sa.Integer(), nullable=False),
    sa.Column('study_id', sa.Integer(), nullable=True),
    sa.Column('study_name', sa.String(length=200), nullable=True),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('queued', 'running', 'cancelling', 'cancelled', 'finished', 'failed')",
                       name=op.f('ck_advisor_jobs_status')),
    sa.CheckConstraint('devices >= 1', name=op.f('ck_advisor_jobs_devices')),
    sa.ForeignKeyConstraint(['study_id'], ['advisor_studies.id'], name=op.f('fk_advisor_jobs_study_id_advisor_studies'),
                            ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_advisor_jobs'))
    )
    with op.batch_alter_table('advisor_jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_advisor_jobs_status'), ['status'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('advisor_jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_advisor_jobs_status'))

    op.drop_table('advisor_jobs')
