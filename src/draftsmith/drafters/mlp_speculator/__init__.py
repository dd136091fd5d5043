"""draftsmith.drafters.mlp_speculator"""
