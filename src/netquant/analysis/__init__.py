"""netquant.analysis"""
