"""The console's panes, one module each. Every pane renders from ``ConsoleState`` on the app's
tick and repaints only what changed."""

from .datasets import COLUMNS, DatasetsTable
from .gpu import GpuPane
from .server import ServerPane
from .stages import StagesPane
from .status import RunStatus
from .training import TrainingView

__all__ = ["COLUMNS", "DatasetsTable", "GpuPane", "RunStatus", "ServerPane", "StagesPane", "TrainingView"]
