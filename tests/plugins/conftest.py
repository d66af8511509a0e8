"""The plugin tests run against the same throwaway Airflow as the DAG tests (tests/dags/airflow_test_env.py).

Configured on import, before any test module here imports airflow.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dags"))
import airflow_test_env  # noqa: E402

airflow_test_env.configure()
