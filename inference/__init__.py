"""draftsmith.inference"""
