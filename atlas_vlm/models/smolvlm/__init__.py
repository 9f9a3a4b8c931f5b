"""SmolVLM2 (Idefics3 family): tiles and prompt ids from the HF processor (``tiles``,
``prompt``, ``video``), the SigLIP tower + connector (``vision``), the media inputs
(``inputs``) and the family hooks (``family``). The language model is the shared decoder.
"""
