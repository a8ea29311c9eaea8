"""The scheduler's room: one agent's scheduler (scheduler.py), the sequences it tracks (sequence.py),
the step plans it builds (step_plan.py), its KV pool (block_manager.py), how many drafts a decode asks
for (speculative.py) and the sequences it moves out and in with their KV (handover.py)."""
