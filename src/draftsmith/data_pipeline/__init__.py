"""draftsmith.data_pipeline"""
