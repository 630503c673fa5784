"""The ai-toolkit translator: an ai-toolkit job file (``job: extension``, ``config.process[]``) read as a native
config with the same meaning.

``translate`` (detection, the translation), ``table`` (the one table of its keys: same / approximated / ignored /
unsupported), ``facts`` (ai-toolkit's defaults, architectures and spellings, read at ``AIT_COMMIT``). How each
key is read: documentation/MIGRATING_FROM_AI_TOOLKIT.md, generated from the table.
"""
