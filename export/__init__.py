"""draftsmith.export"""
