// Carries the shared precompiled header of the LibTorch tests.
