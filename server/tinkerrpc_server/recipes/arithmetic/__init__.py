"""The arithmetic recipe: RL alone on a pretrained model, judged on held-out addition problems
(task.py: the problems and their checker)."""
