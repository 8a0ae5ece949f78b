"""The recipes `tinkerrpc demo` runs, one package each: its task (task.py: the problems and their
reward, which tests and examples use too) and its run (recipe.py: the settings, loop, summary and plot
behind base.Recipe)."""
