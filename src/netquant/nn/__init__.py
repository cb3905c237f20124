"""netquant.nn"""
