"""The yes / no / maybe recipe: SFT then RL on the random tiny model (task.py: the task)."""
