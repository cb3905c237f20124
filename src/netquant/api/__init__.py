"""netquant.api"""
