"""The input contracts the model families implement, below the engine.

Scope: what a family folder under ``atlas_vlm/models/`` needs to turn a chat prompt into prompt
ids and media items without reaching up into ``engine/``: the media-input base class
(``media.MediaInputs``, which ``ModelFamily.mm_inputs`` subclasses name), the error a request
that can never fit raises (``media.RequestTooLongError``) and the fallback tools prompt
(``tool_prompt.render_with_tools``). Imports only ``mm_token_pipeline`` and the standard
library (``tests/test_import_graph.py`` keeps it so); the engine's ``InputProcessor`` and
``ChatInput`` build on it.
"""
