"""Field docs of a settings dataclass, read from its source (vLLM's ``get_attr_docs``).

Scope: ``attr_docs(cls)`` maps each field to its text: the attribute docstring (a string
literal right under the field, as vLLM's configs write them) or, where there is none, the
``#`` comment on the field's line and the comment block right above it (how
``mm_token_pipeline.fetch_policy.MediaFetchPolicy`` documents its fields). Base classes are
read first, so a subclass's doc wins. The CLI help of every generated flag comes from here
(``atlas_vlm.config.cli``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import textwrap
import tokenize


@functools.lru_cache(maxsize=None)
def attr_docs(cls: type) -> dict[str, str]:
    """``{field name: one-paragraph text}`` for the annotated attributes of ``cls`` that have
    a docstring or a comment; a class whose source cannot be read (built in, interactive)
    gives ``{}``."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        docs.update(_class_docs(source))
    return docs


def _class_docs(source: str) -> dict[str, str]:
    tree = ast.parse(source)
    cls_node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    comments, code_rows = _comments(source)
    docs = {}
    body = cls_node.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            text = inspect.cleandoc(after.value.value)
        else:
            above, row = [], node.lineno - 1
            while row in comments and row not in code_rows:  # the comment block right above
                above.insert(0, comments[row])
                row -= 1
            trailing = [comments[r] for r in range(node.lineno, node.end_lineno + 1) if r in comments]
            text = " ".join(above + trailing)
        if text.strip():
            docs[node.target.id] = " ".join(text.split())
    return docs


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """``({row: comment text without '#'}, {rows that hold code})``, rows 1-based."""
    comments, code_rows = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_rows.add(tok.start[0])
    return comments, code_rows
