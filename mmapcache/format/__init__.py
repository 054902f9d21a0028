"""What a sample is, and how it is encoded: the layer every other one stands on.

Owns: the kinds of leaf and their storage (``fields``), a sample's tree of fields and the layout check (``tree``,
``layout``), converting stored values back into samples and batches (``codec``), the fast checks of a source's
samples on the publish path (``check``, ``batch``), sizes like ``"8G"`` (``sizes``), and the on-disk format's
definition: file names, ``meta.json``'s schema and its validation, the byte-level document (``spec``).

Imports: numpy (torch only where a tensor is converted), ``mmapcache.errors``. Nothing here opens a file.
"""
