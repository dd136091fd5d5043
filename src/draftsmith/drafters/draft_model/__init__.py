"""draftsmith.drafters.draft_model"""
