"""Memory planning: the estimator, auto-config, presets (the machine itself: :mod:`simpletuner.hardware`).

:mod:`.estimator` / :mod:`.step_memory` / :mod:`.measure` (the estimate and its check against a real step),
:mod:`.autoconfig` (``plan_batch``), :mod:`.advice`, :mod:`.presets`, :mod:`.apply` (``--apply``),
:mod:`.report` (with :mod:`.estimated_config`, the config it judges, read before torch), :mod:`.estimate_store`,
:mod:`.preflight` and :mod:`.oom` (the trainer's two questions);
the ``simpletuner estimate`` command is :mod:`simpletuner.cli.estimate`. Import the module you need: this
package imports none of them.
"""
