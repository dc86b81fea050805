"""KV-cache bookkeeping and step planning (pure Python, never imports torch)."""
from scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Scheduler", "SchedulerStats"]
