"""The SimpleTuner translator: a SimpleTuner config read as a native one with the same meaning.

``translate`` (the translation and the table ``DIALECT``), ``mapped`` / ``mapped_datasets`` (the keys with a
counterpart here), ``unmapped`` (the rest, and why), ``semantics`` (meanings that span keys), ``facts``
(SimpleTuner's families, defaults and spellings), ``reading`` (its value spellings, the translation's record).
"""
