"""DFlash (Chen et al. 2026): a block drafter writing every draft of a verify step in one forward."""
