"""The user's model in the form the transforms need.

- ``functional``: a module or function as a pure function of its parameters;
- ``shell``: private shells of a module, so that no forward pass writes into the user's;
- ``wrappers``: compiled modules looked through, and checkpoints run plain while a kernel is computed;
- ``requires_grad``: hooks that ask for gradients, made harmless under the transforms;
- ``inner_derivatives``: models that take derivatives inside their forward pass, in a level of their own;
- ``fingerprint``: a module's structure, for caches and resumes;
- ``unfused``: fused PyTorch kernels computed as plain operations where transforms need it;
- ``torch_errors``: PyTorch's errors explained in torchntk's words.
"""
