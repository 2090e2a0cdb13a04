"""Image input: opening images safely (regular files only, decompression-bomb limits, EXIF orientation), the
model-input image under a policy, blank copies (``images``) and the JPEG header walk (``jpeg``).

May import: ``frame`` and this sub-package.
"""
