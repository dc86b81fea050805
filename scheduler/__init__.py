"""KV-cache bookkeeping and step planning (pure Python, never imports torch)."""
from scheduler.scheduler import Scheduler
from scheduler.scheduler_stats import SchedulerStats

__all__ = ["Scheduler", "SchedulerStats"]
